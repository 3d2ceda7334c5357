"""``deeppool run``: start the ranks on this machine (torchrun's elastic agent) and report.

The launcher refuses a plan that does not fit before starting anything (wrong
``--nproc``, a model that does not match the plan, a model whose layers mix
the samples of a batch: :mod:`deeppool.model.batching`), then runs ``nproc``
workers with ``torch.distributed.launcher.elastic_launch`` (what torchrun runs
underneath; no restarts). If any worker fails, the agent stops the others, and
the launcher names the rank at fault: the earliest error a rank raised itself,
else a rank that stopped responding (:mod:`deeppool.executor.launch.hangwatch`), else
a rank that died by a signal, else the earliest communication failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from deeppool.errors import DeeppoolError
from deeppool.executor.config import CONFIG_FILE, Nodes, RankConfig, RunConfig
from deeppool.executor.engine.local_model import check_plan_matches
from deeppool.executor.launch.hangwatch import HangWatch
from deeppool.executor.training.outputs import EVENTS, RESIZE, STEPS, STOPPED
from deeppool.interrupt import Interrupted
from deeppool.model.batching import check_per_sample, check_plan_batches
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import Plan

_PRIMARY = ("user", "check", "crash")
PLAN_VARIABLE = "DEEPPOOL_PLAN"
"""The environment variable that gives a ``--script``'s ranks the plan's path."""
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What the agent (or Ctrl-C) stops ranks with: not the cause of a failure."""
_AGENT_LOGS = "torch.distributed.elastic"


class RunFailed(DeeppoolError):
    """A rank failed; ``exit_code`` is the worker's (3: check over its bound)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    rank: int
    kind: str
    message: str
    time: float


def preflight(plan: Plan, nproc: int, nodes: Nodes = Nodes()) -> None:
    """Everything that can be refused before a rank starts."""
    if nproc * nodes.count != plan.gpus:
        per_node = f" on each of {nodes.count} machines" if nodes.count > 1 else ""
        raise DeeppoolError(f"--nproc {nproc}{per_node} differs from the plan's {plan.gpus} GPUs: "
                            f"use --nproc {plan.gpus // nodes.count if plan.gpus % nodes.count == 0 else plan.gpus} "
                            "or re-plan for this many")
    loaded = load_model(plan.model)
    traced = trace(loaded)
    check_plan_matches(plan, traced.graph)
    check_per_sample(traced, loaded, seed=plan.model.seed)
    smallest = {layer.name: min(end - start for start, end in layer.samples) for layer in plan.layers if layer.samples}
    check_plan_batches(traced, loaded, smallest, seed=plan.model.seed)


def launch(plan: Plan, plan_path: Path, *, nproc: int, config: RunConfig, nodes: Nodes = Nodes(),
           extra: Mapping[str, Any] | None = None, script: Path | None = None,
           script_args: Sequence[str] = ()) -> None:
    """Start ``nproc`` ranks here; with several ``nodes``, this machine's share of the run (see :class:`Nodes`).

    ``plan`` is the caller's, loaded once; ``plan_path`` is the file it was loaded from (or saved to), which
    every rank reads. Every rank reads its settings from one file, ``config`` and ``extra`` (the layers above's,
    by name) written into the run's ``--out`` (:class:`~deeppool.executor.config.RankConfig`). With ``script``
    the ranks run the user's script instead (``script_args`` its arguments; ``deeppool run --script``), which
    finds the plan's path in ``$DEEPPOOL_PLAN`` and calls ``deeppool.parallelize``.
    """
    if script is None:
        preflight(plan, nproc, nodes)
    ranks_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))}
    if script is not None:
        ranks_env[PLAN_VARIABLE] = str(plan_path.resolve())
    with _environment(ranks_env):
        _launch(plan, plan_path, nproc=nproc, config=config, extra=extra or {}, nodes=nodes, script=script,
                script_args=script_args)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` (the ranks inherit them) while the block runs; the variables as they
    were afterwards, so that a caller in the same process (the coordinator's driver, a test) is not left
    with a finished run's plan."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _launch(plan: Plan, plan_path: Path, *, nproc: int, config: RunConfig, extra: Mapping[str, Any], nodes: Nodes,
            script: Path | None, script_args: Sequence[str]) -> None:
    out = config.out_dir
    assert out is not None
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("error-rank*.json"), out / EVENTS, out / RESIZE, out / STEPS, out / STOPPED]:
        stale.unlink(missing_ok=True)
    if script is None:
        RankConfig(run=config, extra=dict(extra)).save(out / CONFIG_FILE)
        argv: tuple[str, ...] = ("-m", "deeppool.executor", str(plan_path), str(out / CONFIG_FILE))
    else:
        argv = (str(script), *script_args)
    if nodes.count > 1:
        print(f"machine {socket.gethostname()} ({_facing_address(nodes)}): {nproc} of the {plan.gpus} ranks, "
              f"meeting {nodes.count - 1} other machine(s) at {nodes.endpoint}", flush=True)
    launch_config = LaunchConfig(
        min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=nproc, run_id=nodes.run_id or str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=nodes.endpoint or "127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        rdzv_configs={"join_timeout": config.timeout_s, **_hosting(nodes)}, local_addr=_facing_address(nodes),
    )
    agent_logs = _agent_loggers()
    levels = [log.level for log in agent_logs]
    for log in agent_logs:
        log.setLevel(logging.CRITICAL)  # the launcher names the failed rank itself, and says "interrupted"
    watch = HangWatch(recorded=lambda: {f.rank: f.kind for f in _recorded(out)}, nproc=plan.gpus)
    try:
        with watch:
            elastic_launch(launch_config, sys.executable)(*argv)
    except ChildFailedError as err:
        raise _failure(err, out, nproc, watch.hung) from None
    except (SignalException, KeyboardInterrupt):
        raise Interrupted() from None
    finally:
        for log, level in zip(agent_logs, levels, strict=True):
            log.setLevel(level)


def _agent_loggers() -> list[logging.Logger]:
    """torch's elastic agent logs from one logger per module, each with its own level."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith(_AGENT_LOGS)]
    return [logging.getLogger(name) for name in sorted({_AGENT_LOGS, *names})]


def _hosting(nodes: Nodes) -> dict[str, bool]:
    """Whether this machine hosts the rendezvous store: the endpoint's address is one of its own.

    torch guesses this from host names, which fails where the name resolves elsewhere (containers,
    network namespaces); an address this machine can bind is an address it has. A loopback endpoint
    (several launchers on one machine) is left to torch, which lets the first launcher host and the
    others connect.
    """
    if nodes.endpoint is None:
        return {}
    host = nodes.endpoint.rpartition(":")[0].strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return {}
    except ValueError:
        return {}  # a host name: torch's own matching applies
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
    except OSError:
        return {"is_host": False}
    return {"is_host": True}


def _facing_address(nodes: Nodes) -> str | None:
    """This machine's address on the route to the endpoint: what the other machines can reach it at.

    The agent would otherwise advertise its host name, which may resolve to a loopback address.
    """
    if nodes.endpoint is None:
        return None
    host, _, port = nodes.endpoint.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host.strip("[]"), int(port)))  # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _failure(err: ChildFailedError, out: Path, nproc: int, hung: set[int]) -> DeeppoolError:
    recorded = _recorded(out)
    primary = [f for f in recorded if f.kind in _PRIMARY]
    if primary:
        first = min(primary, key=lambda f: f.time)
        code = 3 if first.kind == "check" else 1
        return RunFailed(f"rank {first.rank} failed: {first.message}" if first.kind != "check" else first.message, code)
    if hung:
        waiting = ", ".join(str(f.rank) for f in sorted(recorded, key=lambda f: f.rank))
        return RunFailed(
            f"rank {min(hung)} stopped responding: ranks {waiting} failed waiting for it; all ranks were stopped"
        )
    for rank, failure in sorted(err.failures.items()):
        if failure.exitcode < 0 and -failure.exitcode not in _STOP_SIGNALS:
            name = signal.Signals(-failure.exitcode).name
            return RunFailed(f"rank {rank} was killed by {name}; the other ranks were stopped")
    silent = sorted(set(range(nproc)) - {f.rank for f in recorded})
    if recorded and silent:
        waiting = ", ".join(str(f.rank) for f in sorted(recorded, key=lambda f: f.rank))
        return RunFailed(
            f"rank {silent[0]} stopped responding: ranks {waiting} failed waiting for it; all ranks were stopped"
        )
    if recorded:
        first = min(recorded, key=lambda f: f.time)
        return RunFailed(f"rank {first.rank} failed: {first.message}")
    if all(failure.exitcode == -signal.SIGINT for failure in err.failures.values()):
        return Interrupted()  # Ctrl-C reached the ranks before the agent
    rank, failure = min(err.failures.items())
    return RunFailed(f"rank {rank} exited with code {failure.exitcode}")


def _recorded(out: Path) -> list[RankFailure]:
    failures = []
    for path in out.glob("error-rank*.json"):
        try:
            failures.append(RankFailure(**json.loads(path.read_text())))
        except (ValueError, TypeError):
            continue
    return failures
