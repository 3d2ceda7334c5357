"""Names of the files a run writes in its ``--out`` folder that other parts read (no torch needed here).

* ``events.jsonl``: one JSON object a line for each thing the run adapted or found (a straggler, a
  policy's action), written by rank 0 as it happens; the coordinator relays them into the job's events.
* ``resize.json``: a policy asked for another GPU count; ``deeppool run`` re-plans and says how to resume.
* ``stopped.json``: the run stopped resumably because its ``--stop-file`` appeared: after which step, where its
  checkpoint is and when it was written (the coordinator restarts it on another GPU count).
* ``progress.json``: the optimizer steps done and asked for, written by rank 0 at most once a second.
* ``steps.jsonl``: one JSON object a line for each optimizer step (global mean loss, the slowest rank's
  step time, the noise scale), appended by rank 0 each time the ranks gather their step figures
  (``--monitor-every`` steps); ``deeppool run --tensorboard`` follows it while the run goes on.
"""

EVENTS = "events.jsonl"
RESIZE = "resize.json"
STOPPED = "stopped.json"
PROGRESS = "progress.json"
STEPS = "steps.jsonl"
