"""``deeppool serve``, ``token create``, ``submit``, ``jobs``, ``logs`` and ``cancel``: a thin layer over the client.

Only typer is imported here; each command loads its work when it runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deeppool.errors import DeeppoolError

if TYPE_CHECKING:
    import uvicorn

    from deeppool.coordinator.isolation import RunAs
    from deeppool.coordinator.launcher import Launcher
    from deeppool.coordinator.slurm import SlurmSettings
    from deeppool.coordinator.supervisor import JobCaps

MIN_FREE_MB = 512
"""The free space a jobs' folder keeps unless told (``--min-free-mb``), at most an eighth of its own disk."""
MIN_JOBS_DISK_MB = 8
"""The smallest jobs' file system ``--jobs-disk-mb`` makes (ext4's journal and tables take a few MiB)."""
REQUESTS_GRACE_S = 1.0
"""At a stop, how long requests in flight may take to finish: a client that stalls in its body must not hold the
server past the Ctrl-C deadline (:data:`deeppool.interrupt.GRACE_S`), which would end it before it said so."""
token_app = typer.Typer(help="API tokens for the coordinator.", no_args_is_help=True)


def serve(
    db: Annotated[Path, typer.Option(help="SQLite database file (created if missing)")] = Path("deeppool.db"),
    gpus: Annotated[str, typer.Option(help="GPUs to schedule: a number, or auto (the GPUs here, else CPU cores)")] = "auto",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8470,
    allow: Annotated[list[Path] | None, typer.Option(help="a folder model files may come from (repeatable)",
                                                     show_default="the current folder")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="where job logs go (one database's jobs only)",
                                                 show_default="DB's folder/logs/DB's name")] = None,
    device_model: Annotated[str, typer.Option(help="device model foreground jobs are planned with")] = "a100",
    paused: Annotated[bool, typer.Option("--paused", help="accept and queue jobs, start none (drain the cluster)")
                      ] = False,
    policy_name: Annotated[str, typer.Option(
        "--policy", help="the scheduling policy: a name `deeppool simulate --policy` takes (pollux resizes running "
        "jobs and changes their batch; burst+demand is refused: it needs plan offers)")] = "fifo-backfill:burst+bg",
    policy_interval: Annotated[float | None, typer.Option(
        help="seconds between a tick policy's decisions (pollux; others decide at every event and refuse it)",
        show_default="the policy's own: 60 s for pollux")] = None,
    launcher: Annotated[str, typer.Option(help="local (processes here) or slurm (sbatch; a shared file system)")
                        ] = "local",
    partition: Annotated[str | None, typer.Option(help="the Slurm partition jobs go to")] = None,
    nodes: Annotated[int, typer.Option(help="Slurm nodes each foreground job spans (its GPUs split evenly)")] = 1,
    gres: Annotated[bool | None, typer.Option("--gres/--no-gres", help="ask Slurm for GPUs (--gres=gpu:K per node), "
                                              "else CPU slots", show_default="whether this machine has GPUs")
                    ] = None,
    check: Annotated[bool, typer.Option("--check", help="compare every run with single-process training, step by "
                                        "step (slow: to validate a cluster)")] = False,
    job_user: Annotated[str | None, typer.Option(help="the OS account jobs run as: submitter (the account named "
                                                 "like the token's user) or one ACCOUNT; needed when serve runs "
                                                 "as root (with slurm: sbatch --uid)",
                                                 show_default="this server's user")] = None,
    max_body_kb: Annotated[int, typer.Option(help="request bodies over this many KiB are refused (413) unread")
                           ] = 1024,
    max_pending: Annotated[int, typer.Option(help="jobs one user may have waiting; past it a submission gets 429 "
                                             "(0: no limit)")] = 1000,
    max_submits_per_minute: Annotated[int, typer.Option(help="submissions one user may make a minute; past it, "
                                                        "429 (0: no limit)")] = 600,
    max_client_connections: Annotated[int, typer.Option(help="connections one client (an address; on loopback, "
                                                        "an account) may hold at once; more are refused")] = 64,
    head_timeout_s: Annotated[float, typer.Option(help="seconds a request's head (line and headers) may take to "
                                                  "arrive; then the connection is closed")] = 10.0,
    body_timeout_s: Annotated[float, typer.Option(help="seconds a request's body may stall without a byte; then "
                                                  "the connection is closed")] = 30.0,
    max_events: Annotated[int, typer.Option(help="run events kept per job attempt; later ones are cut, "
                                            "with a notice")] = 1000,
    max_log_mb: Annotated[int, typer.Option(help="a job whose log grows past this many MiB is stopped, "
                                            "its log ending with a notice")] = 1024,
    max_job_pids: Annotated[int, typer.Option(help="processes (threads too) one job may have: its cgroup's "
                                              "pids.max, else RLIMIT_NPROC")] = 4096,
    max_job_memory_mb: Annotated[int | None, typer.Option(help="memory one job may use, MiB: its cgroup's "
                                                          "memory.max, else RLIMIT_DATA", show_default="none")] = None,
    max_job_disk_mb: Annotated[int | None, typer.Option(help="disk one job's folder may take, MiB (past it the job "
                                                        "is stopped); also the size of its private /tmp and /dev/shm",
                                                        show_default="none")] = None,
    keep_job_files_days: Annotated[float | None, typer.Option(help="days an ended job's files (log, checkpoints) "
                                                              "are kept; then they are removed",
                                                              show_default="kept")] = None,
    min_free_mb: Annotated[int | None, typer.Option(help="free space the jobs' folder keeps, MiB: below it, the "
                                                    "files of the jobs that ended first are removed (0: never)",
                                                    show_default=f"{MIN_FREE_MB}, or an eighth of the jobs' own "
                                                    "disk if less")] = None,
    jobs_disk_mb: Annotated[int | None, typer.Option(help="give the jobs' folder a file system of its own of this "
                                                     "many MiB, apart from the database's: an ext4 image beside "
                                                     "it, made once and loop-mounted (root, --launcher local; "
                                                     "0: none, the folder on the database's)",
                                                     envvar="DEEPPOOL_JOBS_DISK_MB",
                                                     show_default="as root, a quarter of the database's free space "
                                                     "when first made")] = None,
) -> None:
    """Run the coordinator: a REST API (OpenAPI at /docs) over an embedded database.

    Prints one line when it serves (URL, database, GPUs, policy, launcher) and one when it stops.
    """
    if not 0 < port < 65536:
        raise DeeppoolError(f"--port {port} must be in 1..65535")
    for flag, number in (("--max-pending", max_pending), ("--max-submits-per-minute", max_submits_per_minute)):
        if number < 0:
            raise DeeppoolError(f"{flag} {number} must be 0 (no limit) or more")
    for flag, number in (("--max-client-connections", max_client_connections), ("--head-timeout-s", head_timeout_s),
                         ("--body-timeout-s", body_timeout_s)):
        if not number > 0:
            raise DeeppoolError(f"{flag} {number} must be more than 0")
    for flag, value in (("--max-body-kb", max_body_kb), ("--max-events", max_events), ("--max-log-mb", max_log_mb),
                        ("--max-job-pids", max_job_pids),
                        ("--max-job-memory-mb", 1 if max_job_memory_mb is None else max_job_memory_mb),
                        ("--max-job-disk-mb", 1 if max_job_disk_mb is None else max_job_disk_mb)):
        if value < 1:
            raise DeeppoolError(f"{flag} {value} must be at least 1")
    if jobs_disk_mb and launcher == "slurm":
        raise DeeppoolError("--jobs-disk-mb is for --launcher local: under Slurm the jobs' folder must be on the "
                            "file system the nodes share (give it its own with --log-dir, and --jobs-disk-mb 0)")
    if jobs_disk_mb and jobs_disk_mb < MIN_JOBS_DISK_MB:
        raise DeeppoolError(f"--jobs-disk-mb {jobs_disk_mb} must be at least {MIN_JOBS_DISK_MB} (or 0: none)")
    slots = _slots(gpus)
    roots = tuple(root.resolve() for root in (allow or [Path.cwd()]))
    for root in roots:
        if not root.is_dir():
            raise DeeppoolError(f"--allow '{root}' is not a folder")
    if log_dir is not None and log_dir.exists() and not log_dir.is_dir():
        raise DeeppoolError(f"--log-dir '{log_dir}' is a file: give a folder")
    _check_slurm_options(launcher, partition=partition, nodes=nodes, gres=gres)
    from deeppool.coordinator.live_policy import live_policy

    chosen = live_policy(policy_name, interval_s=policy_interval)
    from deeppool.coordinator.store import check_path, default_log_dir

    check_path(db)
    disk_mb, min_free_mb = _disk_sizes(jobs_disk_mb, min_free_mb, launcher=launcher,
                                       logs=log_dir or default_log_dir(db), db=db)
    if keep_job_files_days is not None and keep_job_files_days <= 0:
        raise DeeppoolError(f"--keep-job-files-days {keep_job_files_days} must be more than 0")
    run_as = _run_as(job_user, logs=log_dir or default_log_dir(db), paused=paused)
    if launcher == "slurm":
        from deeppool.coordinator.slurm import check_slurm

        check_slurm()
    import logging

    import uvicorn

    from deeppool.coordinator.app import ServerSettings, create_app
    from deeppool.coordinator.connections import (
        connection_budget,
        guarded_protocol,
        log_once,
        raise_descriptor_limit,
    )
    from deeppool.coordinator.driver import DriverSteps
    from deeppool.coordinator.elastic import Elastic
    from deeppool.coordinator.retention import Retention, Sweeper
    from deeppool.coordinator.runtime import JobLimits, Runtime
    from deeppool.coordinator.service import Service
    from deeppool.coordinator.slurm import SlurmSettings
    from deeppool.coordinator.store import Store, claim_log_dir, lock_database
    from deeppool.coordinator.supervisor import JobCaps

    descriptors, _ = raise_descriptor_limit()  # soft to hard, as systemd's LimitNOFILE: connections need many
    before = os.umask(0o077)  # the database, logs and files of the server: its user's alone
    with contextlib.ExitStack() as held:  # the port, the lock and the database, released in that order's reverse
        held.callback(os.umask, before)  # serve called in a process that goes on (tests) leaves its umask as it was
        listening = held.enter_context(_listen(host, port))  # before anything is created: a port in use changes nothing
        held.enter_context(lock_database(db))
        store = Store(db)
        held.callback(store.close)
        logs = log_dir or default_log_dir(db)
        _make_passable(logs)
        if disk_mb is not None:  # before the claim: the folder's state lock is in the jobs' own file system
            _own_disk(held, logs, db, disk_mb, by_default=jobs_disk_mb is None)
        held.enter_context(claim_log_dir(logs, store.identity()))  # one state's jobs: never another server's
        device = "cuda" if _gpu_count() else "cpu"
        settings = ServerSettings(gpus=slots, allowed_roots=roots, log_dir=logs, device=device, nodes=nodes,
                                  max_body_bytes=max_body_kb << 10, max_pending=max_pending,
                                  submits_per_minute=max_submits_per_minute,
                                  retention=Retention(keep_s=None if keep_job_files_days is None
                                                      else keep_job_files_days * 86400, min_free_bytes=min_free_mb << 20))
        slurm = SlurmSettings(partition=partition, gres=_gpu_count() > 0 if gres is None else gres)
        caps = JobCaps(pids=max_job_pids, memory_bytes=None if max_job_memory_mb is None else max_job_memory_mb << 20,
                       disk_bytes=None if max_job_disk_mb is None else max_job_disk_mb << 20)
        runtime = Runtime(store, _launcher(launcher, logs, slurm, caps, max_log_mb << 20),
                          DriverSteps(folder=logs, device_model=device_model, check=check, nodes=nodes,
                                      run_as=run_as, allowed_roots=roots, elastic=chosen.elastic,
                                      measure_gns=chosen.measures_noise),
                          after_claim=_crash if os.environ.get(FAULT) == "crash-after-claim" else None, nodes=nodes,
                          run_as=run_as, limits=JobLimits(max_events=max_events, max_log_bytes=max_log_mb << 20),
                          allowed_roots=roots)
        policy = chosen.policy
        service = Service(runtime, policy, slots, paused=paused,
                          elastic=Elastic(runtime, slots) if chosen.elastic else None)
        sweeper = Sweeper(store, logs, settings.retention)
        sweeper.start()
        held.callback(sweeper.stop)
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s", level=logging.WARNING)
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        typer.echo(f"deeppool serve: {url}, database {db.resolve()}, {slots} "
                   f"{'GPUs' if device == 'cuda' else 'CPU slots'}, policy {policy.name}"
                   f"{' (paused)' if paused else ''}, launcher {launcher}", err=True)
        backlog, most = connection_budget(descriptors)
        config = uvicorn.Config(create_app(store, settings, service), log_level="warning",
                                timeout_graceful_shutdown=REQUESTS_GRACE_S, backlog=backlog,
                                http=guarded_protocol(per_client=max_client_connections, head_timeout_s=head_timeout_s,
                                                      body_timeout_s=body_timeout_s, total=most))
        log_once()  # after uvicorn set up its loggers: each condition once, its repeats counted
        stopped_by = _run(uvicorn.Server(config), listening)
    typer.echo(f"deeppool serve: stopped{' by ' + stopped_by if stopped_by else ''} ({url}, database "
               f"{db.resolve()})", err=True)
    if stopped_by == signal.SIGINT.name:
        from deeppool.interrupt import Interrupted

        raise Interrupted()


def _disk_sizes(asked: int | None, min_free_mb: int | None, *, launcher: str, logs: Path,
                db: Path) -> tuple[int | None, int]:
    """The size of the jobs' own file system (None: none; ``asked`` unless None, where a root server with the
    local launcher takes :func:`~deeppool.coordinator.jobsdisk.default_size_mb`) and the free space the jobs'
    folder keeps (``--min-free-mb``: unless given, :data:`MIN_FREE_MB`, at most an eighth of that size)."""
    from deeppool.coordinator.jobsdisk import default_size_mb

    if asked is None and launcher == "local" and os.geteuid() == 0:
        asked = default_size_mb(logs, db) or None
    disk_mb = asked or None
    if min_free_mb is None:
        min_free_mb = MIN_FREE_MB if disk_mb is None else min(MIN_FREE_MB, disk_mb // 8)
    if min_free_mb < 0:
        raise DeeppoolError(f"--min-free-mb {min_free_mb} must be at least 0")
    if disk_mb is not None and disk_mb <= min_free_mb:
        raise DeeppoolError(f"--jobs-disk-mb {disk_mb} must be more than --min-free-mb {min_free_mb} (the free "
                            "space the jobs' folder keeps)")
    return disk_mb, min_free_mb


def _own_disk(held: contextlib.ExitStack, logs: Path, db: Path, size_mb: int, *, by_default: bool) -> None:
    """Mount the jobs' own file system at ``logs`` (:mod:`deeppool.coordinator.jobsdisk`), unmounted at the stop;
    one line each time says what was done (and, for an image made by default, how to choose)."""
    from deeppool.coordinator.jobsdisk import mount_jobs_disk, unmount_jobs_disk

    disk = mount_jobs_disk(logs.resolve(), db, size_mb)
    chose = ("; by default a quarter of the database's free space: --jobs-disk-mb N for another size, 0 for none"
             if disk.made and by_default else "")
    typer.echo(f"deeppool serve: {disk.detail}{chose}", err=True)
    if disk.mounted:
        held.callback(lambda: typer.echo(f"deeppool serve: {unmount_jobs_disk(disk)}", err=True))


def _run(server: uvicorn.Server, listening: socket.socket) -> str | None:
    """Serve on ``listening`` until a signal stops the server; the signal's name, if one did."""
    stopped_by: list[str] = []
    for signum in (signal.SIGINT, signal.SIGTERM):  # uvicorn raises the signal again when it has stopped: note it
        signal.signal(signum, lambda number, frame: stopped_by.append(signal.Signals(number).name))
    server.run(sockets=[listening])
    return stopped_by[0] if stopped_by else None


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn serves on it); a port in use is one error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise DeeppoolError(f"--host '{host}' is not an address here ({err.strerror})") from None
    listening = socket.socket(family, kind, proto)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind(address)
        listening.listen(2048)
    except OSError as err:
        listening.close()
        hint = ": stop what uses it, or give another --port" if err.errno == errno.EADDRINUSE else ""
        raise DeeppoolError(f"cannot listen on {host}:{port} ({err.strerror}){hint}") from None
    listening.set_inheritable(True)
    return listening


def _make_passable(folder: Path) -> None:
    """Create ``folder`` and its missing parents 0711 (the server's umask would make them 0700): job accounts
    pass through them to their own folders, never list them."""
    for missing in [path for path in (folder, *folder.parents) if not path.exists()][::-1]:
        missing.mkdir(exist_ok=True)
        os.chmod(missing, 0o711)


def _check_slurm_options(launcher: str, *, partition: str | None, nodes: int, gres: bool | None) -> None:
    if launcher not in ("local", "slurm"):
        raise DeeppoolError(f"--launcher '{launcher}' must be local or slurm")
    for flag, given in (("--partition", partition is not None), ("--nodes", nodes != 1), ("--gres", gres is not None)):
        if given and launcher != "slurm":
            raise DeeppoolError(f"{flag} is for --launcher slurm: add --launcher slurm or leave {flag} out")
    if nodes < 1:
        raise DeeppoolError(f"--nodes {nodes} must be at least 1")


def _run_as(job_user: str | None, *, logs: Path, paused: bool) -> RunAs:
    """``--job-user``: refused where it cannot hold (not root, a log folder jobs cannot reach); and required of
    a root server, whose jobs would otherwise run as root (unless ``--paused``: it starts none). With
    ``--launcher slurm``, root submits each job as its account (``sbatch --uid --gid``)."""
    from deeppool.coordinator.isolation import RunAs

    root = os.geteuid() == 0
    if job_user is None:
        if root and not paused:
            raise DeeppoolError("serve runs as root, so its jobs would too: give --job-user submitter (each "
                                "user's jobs as the OS account of that name) or --job-user ACCOUNT")
        return RunAs()
    if not root:
        raise DeeppoolError("--job-user needs serve to run as root: it starts each job as its account")
    from deeppool.coordinator.isolation import closed_to_others

    folder = logs.resolve()
    closed = closed_to_others(folder.parent)
    if closed is not None:
        raise DeeppoolError(f"jobs cannot reach --log-dir '{folder}': '{closed}' is closed to other users "
                            f"(chmod o+x '{closed}', or choose another --log-dir)")
    import deeppool

    for python in (Path(os.path.realpath(sys.executable)), Path(sys.executable).absolute(),
                   Path(deeppool.__file__).resolve().parent):  # the interpreter, a venv's, the package jobs import
        closed = closed_to_others(python)
        if closed is not None:
            raise DeeppoolError(f"job accounts cannot run this Python ('{python}'): '{closed}' is closed to other "
                                "users; install deeppool where every account can run it")
    return RunAs.parse(job_user)


def _launcher(kind: str, folder: Path, slurm: SlurmSettings, caps: JobCaps | None = None,
              max_log_bytes: int | None = None) -> Launcher:
    """The local launcher (each job held to ``caps``), or Slurm's (Slurm's cgroup.conf limits its jobs)."""
    if kind == "slurm":
        from deeppool.coordinator.slurm import SlurmLauncher

        return SlurmLauncher(folder, slurm)
    from deeppool.coordinator.launcher import LocalLauncher
    from deeppool.coordinator.supervisor import JobCaps

    return LocalLauncher(folder, caps=caps or JobCaps(), max_log_bytes=max_log_bytes)  # its writer caps the log


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
    script: Annotated[Path | None, typer.Option(help="a foreground job's own training script, run on every rank "
                                                     "(it calls deeppool.parallelize; see docs/library.md)")] = None,
    input_shape: Annotated[str | None, typer.Option(help="a factory's per-sample input shape, e.g. 3,224,224")] = None,
    input_dtype: Annotated[str | None, typer.Option(help="a factory's input dtype: float32, or int64 for token ids",
                                                    show_default="float32")] = None,
    vocab_size: Annotated[int | None, typer.Option(help="token ids are drawn below this (an integer --input-dtype)")
                          ] = None,
) -> None:
    """Submit a job; prints its id and state."""
    from pydantic import ValidationError

    from deeppool.checks import positive_ints
    from deeppool.coordinator.client import Client
    from deeppool.coordinator.jobs import JobRequest

    if kind not in ("fg", "bg"):
        raise DeeppoolError(f"job kind '{kind}' must be fg or bg")
    path = Path(model)
    if model.endswith(".py"):
        if not path.is_file():
            raise DeeppoolError(f"model file '{model}' does not exist")
        model = str(path.resolve())
    if script is not None and not script.is_file():
        raise DeeppoolError(f"--script '{script}' does not exist")
    try:
        request = JobRequest(kind=kind, model=model, gpus=gpus, batch=batch, steps=steps,
                             amplification=amplification, idempotency_key=key, input_dtype=input_dtype,
                             input_shape=positive_ints(input_shape, "--input-shape", "3,224,224") or None,
                             vocab_size=vocab_size, script=None if script is None else str(script.resolve()))
    except ValidationError as err:
        first = err.errors()[0]
        raise DeeppoolError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
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
    """Print a job's log: all of it as it is now, or with -f as it grows until the job ends."""
    from deeppool.coordinator.client import Client

    client = Client()
    for text in client.follow(job) if follow else client.log(job):
        typer.echo(text, nl=False)


def cancel(job: Annotated[int, typer.Argument(help="job id")]) -> None:
    """Cancel a job that has not finished."""
    from deeppool.coordinator.client import Client

    cancelled = Client().cancel(job)
    typer.echo(f"job {cancelled.id}: {cancelled.state.value}")
