"""Names of the files a run writes in its ``--out`` folder that other parts read (no torch needed here).

* ``events.jsonl``: one JSON object a line for each thing the run adapted or found (a straggler, a
  policy's action), written by rank 0 as it happens; the coordinator relays them into the job's events.
* ``resize.json``: a policy asked for another GPU count; ``deeppool run`` re-plans and says how to resume.
* ``progress.json``: the optimizer steps done and asked for, written by rank 0 at most once a second.
"""

EVENTS = "events.jsonl"
RESIZE = "resize.json"
PROGRESS = "progress.json"
