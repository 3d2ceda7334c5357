"""``deeppool replay``: a slice of a trace on a running coordinator, then in the simulator, side by side.

Only typer is imported here; the command loads its work when it runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from deeppool.errors import DeeppoolError

DEFAULT_POLICY = "fifo-backfill"


def replay(
    trace: Annotated[str, typer.Argument(help="a trace file, or a shipped trace's name (workload-6...)")],
    server: Annotated[str | None, typer.Option(help="the coordinator's URL", show_default="$DEEPPOOL_URL, else "
                                               "http://127.0.0.1:8470")] = None,
    token: Annotated[str | None, typer.Option(help="your API token", show_default="$DEEPPOOL_TOKEN")] = None,
    policy: Annotated[str, typer.Option(help="the policy the coordinator runs (serve --policy): the simulator "
                                        "runs the same")] = DEFAULT_POLICY,
    policy_interval: Annotated[float | None, typer.Option(help="the coordinator's serve --policy-interval (a tick "
                                                          "policy's: pollux); the simulator ticks the same",
                                                          show_default="the policy's own")] = None,
    first: Annotated[int, typer.Option(help="the slice's first job (0: the trace's first arrival)")] = 0,
    jobs: Annotated[int, typer.Option(help="jobs in the slice")] = 24,
    span: Annotated[float, typer.Option(help="seconds the slice's arrivals are compressed into (run times "
                                        "by the same factor)")] = 360.0,
    gpu_scale: Annotated[float | None, typer.Option(help="trace GPUs per coordinator slot",
                                                    show_default="the largest job over the slots")] = None,
    min_run: Annotated[float, typer.Option(help="a job trains at least this many seconds")] = 2.0,
    max_run: Annotated[float, typer.Option(help="a job trains at most this many seconds")] = 90.0,
    mapping: Annotated[Path | None, typer.Option(help="JSON: trace key -> {model, global_batch} (as simulate's)",
                                                 show_default="simulate's defaults")] = None,
    slots: Annotated[int | None, typer.Option(help="with --dry-run: the slots to scale for",
                                              show_default="the coordinator's")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the scaled slice; submit nothing")] = False,
    out: Annotated[Path | None, typer.Option(help="folder for replay.json and allocation.png")] = None,
    timeout: Annotated[float, typer.Option(help="seconds the live run may take; then its jobs are cancelled")
                       ] = 3600.0,
) -> None:
    """Replay a slice of TRACE on a running coordinator and in the simulator, and compare them.

    The slice's arrivals and run times are compressed by one factor, its GPU counts mapped onto the
    coordinator's slots, each trace model mapped to a real model, whose iteration time a short calibration
    job measures first on the coordinator (with --dry-run: a step timed here). The simulator then runs the
    same jobs under the same policy with the speeds the live run measured (under pollux: each job's speed model
    as the coordinator fitted it, its width over time from the policy's decisions). Prints the average JCT and
    makespan of both; --out also gets replay.json and allocation.png (slots over time, live and simulated).
    """
    from deeppool import checks
    from deeppool.coordinator.live_policy import live_policy

    live_policy(policy, interval_s=policy_interval)
    for flag, value in (("--span", span), ("--min-run", min_run), ("--max-run", max_run), ("--timeout", timeout)):
        if not value > 0:
            raise DeeppoolError(f"{flag} {value} must be more than 0")
    if mapping is not None:
        checks.existing_file(mapping, "--mapping")
    if out is not None and out.exists() and not out.is_dir():
        raise DeeppoolError(f"--out '{out}' is a file: give a folder")
    if slots is not None and not dry_run:
        raise DeeppoolError("--slots is for --dry-run: a replay scales for the coordinator's own slots")
    if dry_run and slots is None:
        raise DeeppoolError("--dry-run needs --slots: it asks no coordinator how many it has")
    _replay(trace, server=server, token=token, policy=policy, interval_s=policy_interval, first=first, jobs=jobs, span=span,
            gpu_scale=gpu_scale, min_run=min_run, max_run=max_run, mapping=mapping, slots=slots, dry_run=dry_run,
            out=out, timeout=timeout)


def _replay(trace: str, *, server: str | None, token: str | None, policy: str, interval_s: float | None, first: int,
            jobs: int, span: float,
            gpu_scale: float | None, min_run: float, max_run: float, mapping: Path | None, slots: int | None,
            dry_run: bool, out: Path | None, timeout: float) -> None:
    from deeppool.cluster_sim.models import default_mapping, load_mapping
    from deeppool.cluster_sim.shipped import resolve
    from deeppool.cluster_sim.workload import BackgroundRule, read_workload
    from deeppool.output import console
    from deeppool.replay.lending import lends
    from deeppool.replay.report import (
        comparison_table,
        fit_table,
        loans_line,
        replay,
        resizes_line,
        slice_table,
        speed_table,
        write,
    )
    from deeppool.replay.slicing import SliceSettings, measure_step_s, needs, scale, sharing_cores
    from deeppool.scheduling.policies import policy_named

    workload = read_workload(resolve(trace))
    chosen = load_mapping(mapping) if mapping is not None else default_mapping(spread=False)
    err = console(stderr=True)
    client, step_s = None, sharing_cores(measure_step_s, os.cpu_count() or 1)
    if not dry_run:
        from deeppool.coordinator.client import Client
        from deeppool.replay.live import calibrate

        client = Client(server, token)
        slots = int(client.cluster()["gpus"])
    settings = SliceSettings(slots=slots or 1, first=first, jobs=jobs, span_s=span, gpu_scale=gpu_scale,
                             min_run_s=min_run, max_run_s=max_run,
                             background=BackgroundRule() if lends(policy_named(policy)) else None)
    if client is not None:
        err.print("calibrating: one short job of each model and slot count", highlight=False)
        step_s = calibrate(client, needs(workload, settings, chosen), timeout_s=timeout,
                           say=lambda line: err.print(line, highlight=False))
    cut = scale(workload, settings, chosen, step_s)
    console().print(slice_table(cut))
    if client is None:
        return
    result = replay(cut, client, policy, interval_s=interval_s, timeout_s=timeout, say=lambda line: err.print(line, highlight=False))
    console().print(fit_table(result.fits) if result.fits else speed_table(result.speeds))
    if result.fits:
        console().print(resizes_line(result.live), highlight=False)
    if result.loans is not None:
        console().print(loans_line(result), highlight=False)
    console().print(comparison_table([result.comparison]))
    if out is not None:
        for path in write(result, out):
            err.print(f"wrote {path}", highlight=False)
