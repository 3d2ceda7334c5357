"""``deeppool serve``, ``token create``, ``submit``, ``jobs``, ``logs`` and ``cancel``: a thin layer over the client.

Only typer is imported here; each command loads its work when it runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deeppool.errors import DeeppoolError

if TYPE_CHECKING:
    from deeppool.coordinator.launcher import Launcher
    from deeppool.coordinator.slurm import SlurmSettings

token_app = typer.Typer(help="API tokens for the coordinator.", no_args_is_help=True)


def serve(
    db: Annotated[Path, typer.Option(help="SQLite database file (created if missing)")] = Path("deeppool.db"),
    gpus: Annotated[str, typer.Option(help="GPUs to schedule: a number, or auto (the GPUs here, else CPU cores)")] = "auto",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8470,
    allow: Annotated[list[Path] | None, typer.Option(help="a folder model files may come from (repeatable)",
                                                     show_default="the current folder")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="where job logs go", show_default="DB's folder/logs")] = None,
    device_model: Annotated[str, typer.Option(help="device model foreground jobs are planned with")] = "a100",
    paused: Annotated[bool, typer.Option("--paused", help="accept and queue jobs, start none (drain the cluster)")
                      ] = False,
    launcher: Annotated[str, typer.Option(help="local (processes here) or slurm (sbatch; a shared file system)")
                        ] = "local",
    partition: Annotated[str | None, typer.Option(help="the Slurm partition jobs go to")] = None,
    nodes: Annotated[int, typer.Option(help="Slurm nodes each foreground job spans (its GPUs split evenly)")] = 1,
    gres: Annotated[bool | None, typer.Option("--gres/--no-gres", help="ask Slurm for GPUs (--gres=gpu:K per node), "
                                              "else CPU slots", show_default="whether this machine has GPUs")
                    ] = None,
    check: Annotated[bool, typer.Option("--check", help="compare every run with single-process training, step by "
                                        "step (slow: to validate a cluster)")] = False,
) -> None:
    """Run the coordinator: a REST API (OpenAPI at /docs) over an embedded database."""
    if not 0 < port < 65536:
        raise DeeppoolError(f"--port {port} must be in 1..65535")
    slots = _slots(gpus)
    roots = tuple(root.resolve() for root in (allow or [Path.cwd()]))
    for root in roots:
        if not root.is_dir():
            raise DeeppoolError(f"--allow '{root}' is not a folder")
    if log_dir is not None and log_dir.exists() and not log_dir.is_dir():
        raise DeeppoolError(f"--log-dir '{log_dir}' is a file: give a folder")
    _check_slurm_options(launcher, partition=partition, nodes=nodes, gres=gres)
    if launcher == "slurm":
        from deeppool.coordinator.slurm import check_slurm

        check_slurm()
    import uvicorn

    from deeppool.coordinator.app import ServerSettings, create_app
    from deeppool.coordinator.driver import DriverSteps
    from deeppool.coordinator.runtime import Runtime
    from deeppool.coordinator.service import Service
    from deeppool.coordinator.slurm import SlurmSettings
    from deeppool.coordinator.store import Store
    from deeppool.scheduling import Order, Placement, Scheduler

    store = Store(db)
    logs = log_dir or db.resolve().parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    settings = ServerSettings(gpus=slots, allowed_roots=roots, log_dir=logs,
                              device="cuda" if _gpu_count() else "cpu", nodes=nodes)
    slurm = SlurmSettings(partition=partition, gres=_gpu_count() > 0 if gres is None else gres)
    runtime = Runtime(store, _launcher(launcher, logs, slurm),
                      DriverSteps(folder=logs, device_model=device_model, check=check, nodes=nodes),
                      after_claim=_crash if os.environ.get(FAULT) == "crash-after-claim" else None, nodes=nodes)
    service = Service(runtime, Scheduler(order=Order.FIFO_BACKFILL, placement=Placement.BURST_BG), slots,
                      paused=paused)
    _serve_until_stopped(create_app(store, settings, service), host=host, port=port)


def _serve_until_stopped(app: object, *, host: str, port: int) -> None:
    """uvicorn's server until a signal stops it; Ctrl-C (which uvicorn takes quietly) is reported as such."""
    import signal

    import uvicorn

    from deeppool.interrupt import Interrupted

    stopped_by: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            stopped_by.append(sig)
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    Server(uvicorn.Config(app, host=host, port=port, workers=1, log_level="warning")).run()
    if signal.SIGINT in stopped_by:
        raise Interrupted()


def _check_slurm_options(launcher: str, *, partition: str | None, nodes: int, gres: bool | None) -> None:
    if launcher not in ("local", "slurm"):
        raise DeeppoolError(f"--launcher '{launcher}' must be local or slurm")
    for flag, given in (("--partition", partition is not None), ("--nodes", nodes != 1), ("--gres", gres is not None)):
        if given and launcher != "slurm":
            raise DeeppoolError(f"{flag} is for --launcher slurm: add --launcher slurm or leave {flag} out")
    if nodes < 1:
        raise DeeppoolError(f"--nodes {nodes} must be at least 1")


def _launcher(kind: str, folder: Path, slurm: SlurmSettings) -> Launcher:
    """The local launcher, or Slurm's."""
    if kind == "slurm":
        from deeppool.coordinator.slurm import SlurmLauncher

        return SlurmLauncher(folder, slurm)
    from deeppool.coordinator.launcher import LocalLauncher

    return LocalLauncher(folder)


FAULT = "DEEPPOOL_FAULT"
"""Fault injection for the durability tests: ``crash-after-claim`` kills the server between a job's claim
(committed) and its launch."""


def _crash(job: object) -> None:
    del job
    os._exit(137)


def _gpu_count() -> int:
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


def _slots(gpus: str) -> int:
    if gpus == "auto":
        return _gpu_count() or os.cpu_count() or 1
    try:
        value = int(gpus)
    except ValueError:
        raise DeeppoolError(f"--gpus '{gpus}' is not a number or auto") from None
    if value < 1:
        raise DeeppoolError(f"--gpus {value} must be at least 1")
    return value


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Argument(help="the user the token is for")],
    db: Annotated[Path, typer.Option(help="the coordinator's database file")] = Path("deeppool.db"),
) -> None:
    """Create (or replace) NAME's token; it is printed once, alone on the last line, and stored only as a hash."""
    from deeppool.coordinator.store import Store, check_user_name

    check_user_name(name)
    token = Store(db).create_token(name)
    typer.echo(f"token for {name} (shown once; export DEEPPOOL_TOKEN=...):")
    typer.echo(token)


def submit(
    kind: Annotated[str, typer.Argument(help="fg (a burst-parallel plan on granted GPUs) or bg (idle windows)")],
    model: Annotated[str, typer.Argument(help="model file (.py) or package.module:factory")],
    batch: Annotated[int, typer.Option(help="global batch size")],
    gpus: Annotated[int, typer.Option(help="GPUs for a foreground job")] = 1,
    steps: Annotated[int, typer.Option(help="training steps")] = 100,
    amplification: Annotated[float | None, typer.Option(help="the plan's GPU-time amplification cap")] = None,
    key: Annotated[str | None, typer.Option(help="idempotency key: resubmitting with it returns the same job")] = None,
) -> None:
    """Submit a job; prints its id and state."""
    from pydantic import ValidationError

    from deeppool.coordinator.client import Client
    from deeppool.coordinator.jobs import JobRequest

    if kind not in ("fg", "bg"):
        raise DeeppoolError(f"job kind '{kind}' must be fg or bg")
    path = Path(model)
    if model.endswith(".py"):
        if not path.is_file():
            raise DeeppoolError(f"model file '{model}' does not exist")
        model = str(path.resolve())
    try:
        request = JobRequest(kind=kind, model=model, gpus=gpus, batch=batch, steps=steps,
                             amplification=amplification, idempotency_key=key)
    except ValidationError as err:
        first = err.errors()[0]
        raise DeeppoolError(f"--{first['loc'][0]}: {first['msg']}") from None
    job = Client().submit(request)
    typer.echo(f"job {job.id}: {job.kind.value} {job.state.value}")


def jobs() -> None:
    """Your jobs: id, kind, state, GPUs, progress, age."""
    from deeppool.coordinator.client import Client
    from deeppool.coordinator.report import jobs_table
    from deeppool.output import console

    console().print(jobs_table(Client().jobs()))


def logs(
    job: Annotated[int, typer.Argument(help="job id")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False,
) -> None:
    """Print a job's log."""
    from deeppool.coordinator.client import Client

    client = Client()
    if follow:
        for text in client.follow(job):
            typer.echo(text, nl=False)
    else:
        typer.echo(client.logs(job).text, nl=False)


def cancel(job: Annotated[int, typer.Argument(help="job id")]) -> None:
    """Cancel a job that has not finished."""
    from deeppool.coordinator.client import Client

    cancelled = Client().cancel(job)
    typer.echo(f"job {cancelled.id}: {cancelled.state.value}")
