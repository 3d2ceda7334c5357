"""The simulator against the live coordinator: a slice of a Pollux workload replayed on both, per policy.

    python benchmarks/replay.py [--policy fifo-backfill] [--jobs 20] [--span 300] [--max-run 30] [--write-docs]

For each ``--policy`` it starts ``deeppool serve`` on ``--gpus`` CPU slots (a policy other than the server's
default is passed as ``serve --policy``; a server that refuses it or cannot start is reported, not replayed,
and its region keeps the last figures), replays jobs
``--first`` .. ``--first + --jobs - 1`` of ``--trace`` on it with the small models of
``benchmarks/replay_models/mapping.json`` (:mod:`deeppool.replay`), and simulates the same jobs with the
speeds the live run measured. Goal (issue 43): average JCT and makespan within 15% of the live run's.

As root the server must run its jobs as another account (``--job-user ACCOUNT``), which must be able to run
this Python; the jobs' files go to a fresh folder it can reach. ``--write-docs`` writes the tables into
``docs/simulator.md`` and its picture to ``docs/images/``, one region per policy: ``replay`` and
``replay.png`` for ``fifo-backfill``, ``replay-NAME`` and ``replay-NAME.png`` for another (``pollux``), so a
run of one policy keeps the others' figures (each region is stamped with its own run's commit and load).
A ``pollux`` replay's simulated half runs by the speed models the coordinator fitted
(:mod:`deeppool.replay.adaptive`), at the coordinator's own Pollux interval (``--policy-interval``, passed to
``serve`` and to the simulation alike). Under a lending policy (``fifo-backfill:burst+bg``, region
``replay-fifo-backfill-burst-bg``) the trace's one-GPU jobs are background jobs, and the simulation lends them the
hosts' idle ranks at the live loans' efficiency (:mod:`deeppool.replay.lending`). ``--rank-threads`` sets the
server's ``OMP_NUM_THREADS`` (its jobs' ranks' torch threads); ``--keep`` keeps each run's ``replay.json``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.table import Table

from deeppool.cluster_sim.models import ModelMapping, load_mapping
from deeppool.cluster_sim.shipped import resolve
from deeppool.cluster_sim.workload import BackgroundRule, Workload, read_workload
from deeppool.coordinator.client import Client
from deeppool.coordinator.store import Store
from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.replay.compare import ReplayComparison
from deeppool.replay.lending import lends
from deeppool.replay.live import calibrate
from deeppool.replay.report import (
    PICTURE_FILE,
    ReplayResult,
    comparison_table,
    fit_table,
    loans_line,
    replay,
    resizes_line,
    slice_table,
    speed_table,
    write,
)
from deeppool.replay.slicing import ReplaySlice, SliceSettings, needs, scale
from deeppool.scheduling.policies import ADAPTIVE, policy_named

MAPPING = REPO / "benchmarks" / "replay_models" / "mapping.json"
SERVER_DEFAULT = "fifo-backfill"
"""What ``deeppool serve`` runs without ``--policy`` (its ``fifo-backfill:burst+bg`` decides as ``fifo-backfill``
when every job is a foreground job, as the replay's are)."""
GOAL = 0.15
IMAGES = REPO / "docs" / "images"

app = typer.Typer(add_completion=False)


@dataclass(frozen=True, kw_only=True)
class _Serving:
    """How the benchmark starts each policy's ``deeppool serve``: as whom its jobs run, a tick policy's interval
    (None: the policy's own), its ranks' torch threads (None: the launcher's)."""

    job_user: str | None
    interval_s: float | None
    rank_threads: int | None

    def interval_for(self, policy: str) -> float | None:
        """The interval ``serve`` is given for ``policy``: only a tick policy (pollux) takes one."""
        return self.interval_s if policy in ADAPTIVE else None

    def described(self, policy: str) -> str:
        interval = self.interval_for(policy)
        said = [f" The server decided every {interval:g} s (`serve --policy-interval`)." if interval else ""]
        if self.rank_threads is not None:
            said.append(f" Each job's rank ran {self.rank_threads} torch thread(s) (`OMP_NUM_THREADS`).")
        return "".join(said)


@app.command()
def main(
    policy: Annotated[list[str], typer.Option(help="policies to replay (repeat)")] = [SERVER_DEFAULT],  # noqa: B006
    trace: Annotated[str, typer.Option(help="trace file or shipped name")] = "workload-6",
    first: Annotated[int, typer.Option(help="the slice's first job")] = 0,
    jobs: Annotated[int, typer.Option(help="jobs in the slice")] = 20,
    span: Annotated[float, typer.Option(help="seconds the arrivals are compressed into")] = 300.0,
    max_run: Annotated[float, typer.Option(help="most seconds a job trains")] = 30.0,
    gpus: Annotated[int, typer.Option(help="the coordinator's CPU slots")] = 4,
    job_user: Annotated[str | None, typer.Option(help="the account jobs run as (needed as root)")] = None,
    policy_interval: Annotated[float | None, typer.Option(help="serve --policy-interval for a tick policy "
                                                          "(pollux); the simulation ticks the same")] = None,
    rank_threads: Annotated[int | None, typer.Option(help="torch threads of each job's rank (the server's "
                                                     "OMP_NUM_THREADS, which its jobs inherit)",
                                                     show_default="the launcher's: cores // the job's ranks")] = None,
    keep: Annotated[Path | None, typer.Option(help="also keep each policy's replay.json and picture in "
                                              "KEEP/POLICY")] = None,
    write_docs: Annotated[bool, typer.Option("--write-docs", help="write docs/simulator.md's region of each "
                                             "policy and its picture in docs/images")] = False,
) -> None:
    console = Console(width=160)
    stamp = Stamp.started()
    if os.geteuid() == 0 and job_user is None:
        raise SystemExit("as root, give --job-user ACCOUNT (an account that can run this Python)")
    if rank_threads is not None and rank_threads < 1:
        raise SystemExit(f"--rank-threads {rank_threads} must be at least 1")
    settings = SliceSettings(slots=gpus, first=first, jobs=jobs, span_s=span, max_run_s=max_run)
    serving = _Serving(job_user=job_user, interval_s=policy_interval, rank_threads=rank_threads)
    workload, mapping = read_workload(resolve(trace)), load_mapping(MAPPING)
    for name in policy:
        with tempfile.TemporaryDirectory(prefix="deeppool-replay-") as folder:
            background = BackgroundRule() if lends(policy_named(name)) else None
            outcome = _one(console, (workload, replace(settings, background=background), mapping), name,
                           Path(folder), serving)
            shown: list[Table | str] = ([outcome] if isinstance(outcome, str)
                                        else _shown(outcome, name, trace, serving))
            for item in shown:
                console.print(item)
            if keep is not None and not isinstance(outcome, str):
                shutil.copytree(Path(folder) / "out", keep / name.replace(":", "-"), dirs_exist_ok=True)
            if not write_docs or isinstance(outcome, str):  # a server that did not serve keeps the last figures
                continue
            region, picture = _outputs(name)
            body = "\n\n".join(markdown(item) if isinstance(item, Table) else item for item in shown)
            shutil.copyfile(Path(folder) / "out" / PICTURE_FILE, picture)
            body += (f"\n\n![slots over time, live and simulated, {name}]"
                     f"({picture.relative_to(REPO / 'docs').as_posix()})")
            write_region(REPO / "docs" / "simulator.md", region, body, stamp)
            stamp = Stamp.started()


def _outputs(policy: str) -> tuple[str, Path]:
    """The region of docs/simulator.md and the picture a policy's replay writes."""
    suffix = "" if policy == SERVER_DEFAULT else "-" + policy.replace(":", "-").replace("+", "-")
    return f"replay{suffix}", IMAGES / f"replay{suffix}.png"


def _shown(result: ReplayResult, name: str, trace: str, serving: _Serving) -> list[Table | str]:
    """What a policy's replay shows: the slice, the speeds the simulation ran by, the comparison, the verdict."""
    fitted = (f"`{name}`: speed models as the coordinator fitted them; {resizes_line(result.live)}; each restart "
              f"charged {result.restart_s:.1f} s in the simulation (the median cost of the live resizes that finished)")
    speeds: list[Table | str] = ([fitted, fit_table(result.fits)] if result.fits
                                 else [f"`{name}`: speeds measured live", speed_table(result.speeds)])
    if result.loans is not None:
        speeds.append(f"`{name}`: {loans_line(result)}")
    return [_described(result.slice, trace) + serving.described(name), *speeds, comparison_table([result.comparison]),
            _verdict([result.comparison])]


def _described(cut: ReplaySlice, trace: str) -> str:
    settings = cut.settings
    return (f"{settings.jobs} jobs of `{trace}` from job {settings.first}, arrivals compressed into "
            f"{settings.span_s:.0f} s (time x {cut.time_scale:.4f}), run times held to {settings.min_run_s:.0f}-"
            f"{settings.max_run_s:.0f} s, {cut.gpu_scale:g} trace GPUs a slot, on {settings.slots} CPU slots of a "
            f"{os.cpu_count()}-core machine; models: `{MAPPING.relative_to(REPO).as_posix()}`, each job's steps "
            f"sized by a short calibration job of its model on the same server."
            + (f" Background jobs: {settings.background.describe()} of the trace, on one slot each."
               if settings.background is not None else ""))


def _one(console: Console, trace: tuple[Workload, SliceSettings, ModelMapping], name: str, folder: Path,
         serving: _Serving) -> ReplayResult | str:
    """One policy: a fresh server, calibration, the replay, the server stopped; the result, or why it did not
    run."""
    workload, settings, mapping = trace
    gpus = settings.slots
    db, logs = folder / "deeppool.db", folder / "logs"
    folder.chmod(0o711)
    token = Store(db).create_token("replay")
    port = _free_port()
    options = ["--jobs-disk-mb", "0"]  # the scheduler is measured, not the jobs' disk
    options += ["--job-user", serving.job_user, "--log-dir", str(logs)] if serving.job_user else []
    options += [] if name == SERVER_DEFAULT else ["--policy", name]
    interval = serving.interval_for(name)
    options += [] if interval is None else ["--policy-interval", str(interval)]
    environment = dict(os.environ)
    if serving.rank_threads is not None:
        environment["OMP_NUM_THREADS"] = str(serving.rank_threads)
    with (folder / "serve.log").open("w") as said:
        server = subprocess.Popen([sys.executable, "-m", "deeppool.cli", "serve", "--db", str(db), "--port",
                                   str(port), "--gpus", str(gpus), "--allow", str(REPO), *options], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=said, env=environment)
    try:
        refused = _wait_until_serving(server, port, folder / "serve.log")
        if refused is not None:
            return f"`{name}`: not replayed: `deeppool serve` refused it ({refused})"
        client = Client(f"http://127.0.0.1:{port}", token)
        say = lambda line: console.print(line, highlight=False)
        cut = scale(workload, settings, mapping, calibrate(client, needs(workload, settings, mapping), say=say))
        console.print(slice_table(cut))
        result = replay(cut, client, name, interval_s=interval, say=say)
        write(result, folder / "out")
        return result
    finally:
        server.terminate()
        server.wait(30)


def _wait_until_serving(server: subprocess.Popen, port: int, log: Path) -> str | None:
    """None once the server answers; else the last line it said before it ended."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            said = log.read_text().strip().splitlines()
            return said[-1] if said else f"exit code {server.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return None
        except httpx.TransportError:
            time.sleep(0.2)
    return "it did not answer in 120 s"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _verdict(comparisons: list[ReplayComparison]) -> str:
    parts = []
    for item in comparisons:
        within = abs(item.jct_gap) <= GOAL and abs(item.makespan_gap) <= GOAL
        parts.append(f"`{item.policy}`: average JCT {item.jct_gap:+.1%}, makespan {item.makespan_gap:+.1%} "
                     f"({'within' if within else 'OUTSIDE'} the ±{GOAL:.0%} goal)")
    return "Simulated against live: " + "; ".join(parts) + "."


if __name__ == "__main__":
    app()
