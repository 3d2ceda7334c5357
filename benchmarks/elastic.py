"""What resizing a running job costs in the coordinator: checkpoint, stop, re-plan and restart, in seconds.

    python benchmarks/elastic.py [--widths 1,2] [--steps 40] [--write-docs]

Runs the coordinator's runtime, launcher, driver and planner in-process on a
fresh database (real supervisors, real ``torch.distributed`` ranks on CPU
slots): one foreground job (``benchmarks/models/mlp.py``, batch 32) starts on
2 slots and is moved to each of ``--widths`` in turn, each once it has made a
step of progress on the one before, at a fixed batch. Each resize is
recorded by :mod:`deeppool.coordinator.elastic`: ``checkpoint`` (the ask to
the checkpoint written, the wait for the step boundary included), ``stop``
(the checkpoint to the old attempt's end as the server saw it: the ranks'
teardown, up to a tick), ``plan`` (planning for the new width, or reading the
plan cached when the job had the width before) and ``restart`` (the new
attempt's launch to its first step, less the plan: processes, imports,
tracing, resuming). ``--write-docs`` writes the table into
``docs/coordinator.md`` and ``docs/performance.md`` (region ``elastic``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deeppool.coordinator.driver import DriverSteps
from deeppool.coordinator.elastic import Elastic
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus, WidthChange
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.service import Service
from deeppool.coordinator.store import Store
from deeppool.docregions import Stamp, markdown, write_region
from deeppool.scheduling.scripted import ScriptedResizes

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "models" / "mlp.py"
START_GPUS, BATCH = 2, 32


def measure(widths: list[int], steps: int, root: Path) -> list[WidthChange]:
    store = Store(root / "bench.db")
    store.create_token("bench")
    job, _ = store.submit("bench", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=START_GPUS,
                                              batch=BATCH, steps=steps))
    folder = root / "jobs"
    runtime = Runtime(store, LocalLauncher(folder, cgroups=False),
                      DriverSteps(folder=folder, elastic=True, allowed_roots=(REPO,)), grace_s=30)
    slots = max(START_GPUS, *widths)
    policy = ScriptedResizes(job_id=job.id, widths=list(widths))
    service = Service(runtime, policy, slots, elastic=Elastic(runtime, slots))
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        service.tick()
        current = store.job(job.id)
        assert current is not None
        if current.state.terminal:
            break
        time.sleep(0.2)
    current = store.job(job.id)
    assert current is not None and current.state is JobStatus.SUCCEEDED, [e.reason for e in store.events(job.id)]
    return store.resizes(job.id)


def table(changes: list[WidthChange], load: float) -> Table:
    shown = Table(title=f"resizing a running job ({MODEL.name}, batch {BATCH}, CPU slots): {os.cpu_count()} cores, "
                        f"load {load:.1f}")
    for column in ("resize", "checkpoint s", "stop s", "plan s", "restart s", "total s"):
        shown.add_column(column, justify="left" if column == "resize" else "right")
    for change in changes:
        parts = (change.checkpoint_s, change.stop_s, change.plan_s, change.restart_s)
        total = sum(part or 0.0 for part in parts)
        cached = " (plan cached)" if change.plan_cached else ""
        shown.add_row(f"{change.from_gpus} -> {change.to_gpus} GPUs{cached}: {change.phase.lower()}",
                      *(f"{part:.2f}" if part is not None else "-" for part in parts), f"{total:.2f}")
    return shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,2", help="the GPU counts the job is moved to, in turn")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--write-docs", action="store_true",
                        help="write the table into docs/coordinator.md and docs/performance.md (region 'elastic')")
    args = parser.parse_args()
    widths = [int(width) for width in args.widths.split(",")]
    stamp = Stamp.started()
    with tempfile.TemporaryDirectory() as tmp:
        changes = measure(widths, args.steps, Path(tmp))
    shown = table(changes, os.getloadavg()[0])
    Console().print(shown)
    parts = {name: sum(getattr(c, f"{name}_s") or 0.0 for c in changes) for name in ("checkpoint", "stop", "plan",
                                                                                     "restart")}
    largest = max(parts, key=parts.__getitem__)
    cached = [c for c in changes if c.plan_cached]
    verdict = (f"over {len(changes)} resizes the {largest} is the largest part ({parts[largest]:.1f} s of "
               f"{sum(parts.values()):.1f} s); the checkpoint is {parts['checkpoint']:.2f} s in all"
               + (f"; a width the job had before is not planned again (plan {cached[0].plan_s or 0:.2f} s)"
                  if cached else ""))
    print(verdict)
    if args.write_docs:
        for doc in ("coordinator.md", "performance.md"):
            write_region(REPO / "docs" / doc, "elastic", f"{markdown(shown)}\n\n{verdict}", stamp)


if __name__ == "__main__":
    main()
