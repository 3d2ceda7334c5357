"""Coordinator limits: the status page and list routes with 200k events, and memory under oversized bodies.

    python benchmarks/coordinator_limits.py [--events 200000] [--bodies 4] [--body-mb 200] [--code DIR]
    python benchmarks/coordinator_limits.py --history 200000 [--pending 50000] [--policy pollux] [--write-docs]

Builds a database with 50 jobs, one of which has ``--events`` events (what a
job writing that many lines to its ``events.jsonl`` left in the database
before the per-job cap), starts ``deeppool serve --paused`` on it, and times
``GET /``, ``GET /v1/jobs`` and ``GET /v1/jobs/1`` (median of 5). Then
``--bodies`` clients at once send a ``--body-mb`` MB body without a token and
the server's peak resident memory (``VmHWM``) is read from ``/proc``.
``--code`` runs the server from another checkout of deeppool (to measure the
code before a change: ``git archive BASE deeppool | tar -x -C DIR``).

``--history N`` measures instead what a long history costs (issue 44): a
database with N finished jobs (succeeded, failed, cancelled; two events each)
against one with none, and one with ``--pending`` jobs of one user waiting
(what a server without a pending quota could be given). Each has the same 20
waiting jobs that cannot start. It times one scheduling tick (the server's
``Service.tick``, in this process, median of 20), ``GET /metrics`` on a real
``deeppool serve --paused`` (median of 20), and the time from starting
``serve`` to its first ``/healthz`` answer (Python's imports included), and
gives each as a ratio to the empty history; the first tick of a server
(which reads every waiting job in full once) is timed apart. The recovery
tick (reconcile only) is what runs before the server serves; the queue is
scheduled by the loop after. ``--policy`` (pollux by default) times the
ticks again under that ``serve --policy`` (its speed models and adaptive
state included: an elastic policy's view), in a second table. Goals: a tick
under 20 ms and ``/metrics`` under 50 ms with 200,000 finished jobs; a tick
under 200 ms with the waiting jobs, and under 20 ms with them under pollux;
the first answer within 1 s of the start. As root (with loop devices), it
also times ``serve --jobs-disk-mb`` (``--jobs-disk-mb`` here, 0: not): the
image made and mounted, mounted again, unmounted, and the start with it.
``--write-docs`` writes the tables into ``docs/performance.md`` (region
``coordinator-history``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store, default_log_dir
from deeppool.docregions import Stamp, markdown, write_region

REPO = Path(__file__).resolve().parents[1]
DEFAULT_POLICY = "fifo-backfill:burst+bg"
"""``serve``'s default policy, whose ticks the first table times."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(db: Path, events: int) -> str:
    store = Store(db)
    token = store.create_token("bench")
    for _ in range(50):
        store.submit("bench", JobRequest(kind=JobKind.BACKGROUND, model="bench.mlp:model", batch=8,
                                         input_shape=(16,)))
    store.note(1, [f"straggler report {n}" for n in range(events)], prefix="attempt 1: ")
    store.close()
    return token


def serve(code: Path, db: Path, port: int, options: tuple[str, ...] = ()) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "deeppool.cli", "serve", "--db", str(db), "--port", str(port),
                             "--gpus", "2", "--paused", *options], cwd=code,
                            env={**os.environ, "PYTHONPATH": str(code), "DEEPPOOL_JOBS_DISK_MB": "0"},  # any checkout
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def timed(http: httpx.Client, path: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        http.get(path).raise_for_status()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flood(port: int, megabytes: int) -> None:
    """One client sending a body of ``megabytes`` MB without a token (it stops when the server closes)."""
    block = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
        conn.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (megabytes << 20))
        try:
            for _ in range(megabytes):
                conn.sendall(block)
            conn.recv(4096)
        except OSError:
            pass


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmHWM for pid {pid}")


def fill(db: Path, finished: int, pending: int) -> None:
    """``finished`` ended jobs and ``pending`` waiting ones (two events and one event each), and 20 waiting
    foreground jobs, written straight into the database (its triggers keep the counters)."""
    store = Store(db)
    store.create_token("bench")
    store.close()
    ends = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
    now = "2026-12-01T00:00:00+00:00"
    with sqlite3.connect(db, isolation_level=None) as raw:
        raw.execute("BEGIN")
        rows = [(ends[n % 3].value, "bg" if n % 2 else "fg", 1 if ends[n % 3] is JobStatus.CANCELLED else 0)
                for n in range(finished)] + [(JobStatus.PENDING.value, "bg", 0)] * pending
        rows += [(JobStatus.PENDING.value, "fg", 0)] * 20
        for first in range(0, len(rows), 10_000):
            chunk = rows[first:first + 10_000]
            for state, kind, settled in chunk:
                job = raw.execute("INSERT INTO jobs(owner, kind, state, model, gpus, batch, steps, input_shape, settled,"
                                  " created_at, updated_at) VALUES ('bench', ?, ?, 'bench.mlp:model', ?, 8, 100, '[16]',"
                                  " ?, ?, ?)", (kind, state, 4 if kind == "fg" else 1,
                                                settled, now, now)).lastrowid
                raw.execute("INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (?, NULL, 'PENDING', "
                            "'submitted', ?)", (job, now))
                if state != "PENDING":
                    raw.execute("INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (?, 'PENDING', ?,"
                                " 'ended', ?)", (job, state, now))
        raw.execute("COMMIT")


def tick_s(db: Path, logs: Path, policy: str = DEFAULT_POLICY) -> tuple[float, float, float, float]:
    """The first scheduling tick of the server's loop on ``db`` under ``serve --policy policy`` (it reads every
    waiting job in full), the median of the 20 after it, on a cluster with no free GPU (so the waiting jobs stay
    waiting, and every tick does the same work), the median recovery tick, and the median of 10 ticks each after
    one more job was submitted (the queue changed: what a busy server's ticks do)."""
    from deeppool.coordinator.elastic import Elastic
    from deeppool.coordinator.launcher import LocalLauncher
    from deeppool.coordinator.live_policy import live_policy
    from deeppool.coordinator.runtime import Runtime
    from deeppool.coordinator.service import Service

    store = Store(db)
    chosen = live_policy(policy)
    runtime = Runtime(store, LocalLauncher(logs), lambda job, attempt, guests: [["true"]])
    service = Service(runtime, chosen.policy, 0, elastic=Elastic(runtime, 0) if chosen.elastic else None)
    start = time.perf_counter()
    assert service.tick().empty
    first = time.perf_counter() - start
    times, recoveries = [], []
    for _ in range(20):
        start = time.perf_counter()
        decision = service.tick()
        times.append(time.perf_counter() - start)
        assert decision.empty, decision
        start = time.perf_counter()
        service.tick(schedule=False)  # what runs before the server serves
        recoveries.append(time.perf_counter() - start)
    moved = []
    for _ in range(10):
        store.submit("bench", JobRequest(kind=JobKind.BACKGROUND, model="bench.mlp:model", batch=8,
                                         input_shape=(16,)))
        start = time.perf_counter()
        assert service.tick().empty
        moved.append(time.perf_counter() - start)
    store.close()
    return first, statistics.median(times), statistics.median(recoveries), statistics.median(moved)


def started_s(db: Path, port: int) -> tuple[float, subprocess.Popen]:
    """How long ``deeppool serve`` takes to answer its first ``/healthz`` (imports and recovery included)."""
    began = time.perf_counter()
    proc = serve(REPO, db, port)
    return time.perf_counter() - began, proc


def history(args: argparse.Namespace) -> None:
    stamp = Stamp.started()
    cases = {"empty history": (0, 0), f"{args.history:,} finished jobs": (args.history, 0),
             f"{args.pending:,} jobs of one user waiting": (0, args.pending)}
    found: dict[str, tuple[float, float, float, float, float, float]] = {}
    other: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (finished, pending) in cases.items():
            db = Path(tmp) / f"{finished}-{pending}.db"
            fill(db, finished, pending)
            first, tick, recovery, moved = tick_s(db, Path(tmp) / "logs")
            if args.policy:
                db = Path(tmp) / f"{finished}-{pending}-{args.policy}.db"  # its own: the default's ticks wrote
                fill(db, finished, pending)
                first_other, tick_other, _, moved_other = tick_s(db, Path(tmp) / "logs", args.policy)
                other[name] = (first_other, tick_other, moved_other)
            port = free_port()
            start, server = started_s(db, port)
            try:
                http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
                scrape = timed(http, "/metrics", 20)
            finally:
                server.terminate()
                server.wait(10)
            found[name] = (first, tick, moved, recovery, scrape, start)
        disk = jobs_disk(Path(tmp), args.jobs_disk_mb)
    table = Table(title=f"coordinator with history: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    for column in ("database", "first tick ms", "tick ms", "x empty", "tick after a submission ms",
                   "recovery tick ms", "GET /metrics ms", "x empty", "serve --paused to first answer s", "x empty"):
        table.add_column(column, justify="left" if column == "database" else "right")
    base = found["empty history"]
    for name, (first, tick, moved, recovery, scrape, start) in found.items():
        table.add_row(name, f"{1e3 * first:.1f}", f"{1e3 * tick:.1f}", f"{tick / base[1]:.2f}", f"{1e3 * moved:.1f}",
                      f"{1e3 * recovery:.1f}", f"{1e3 * scrape:.1f}", f"{scrape / base[4]:.2f}", f"{start:.2f}",
                      f"{start / base[5]:.2f}")
    Console().print(table)
    _, tick, _, _, scrape, _ = found[f"{args.history:,} finished jobs"]
    first, queued, moved, _, _, start = found[f"{args.pending:,} jobs of one user waiting"]
    worst = max(queued, moved)
    verdict = (f"with {args.history:,} finished jobs: tick {1e3 * tick:.1f} ms (goal < 20 ms: "
               f"{'met' if tick < 0.020 else 'NOT met'}), /metrics {1e3 * scrape:.1f} ms (goal < 50 ms: "
               f"{'met' if scrape < 0.050 else 'NOT met'}); with {args.pending:,} waiting: a tick {1e3 * queued:.1f} "
               f"ms, {1e3 * moved:.1f} ms after a submission (goal < 200 ms: {'met' if worst < 0.200 else 'NOT met'}; "
               f"{1e6 * (moved - base[2]) / max(1, args.pending):.2f} us a waiting job), the first tick "
               f"{1e3 * first:.0f} ms ({1e6 * (first - base[0]) / max(1, args.pending):.1f} us a waiting job, once), "
               f"first answer {start:.2f} s after start (goal < 1 s: {'met' if start < 1.0 else 'NOT met'})")
    print(verdict)
    body = f"{markdown(table)}\n\n{verdict}"
    if other:
        ticks = policy_table(args, other)
        Console().print(ticks)
        first, queued, moved = other[f"{args.pending:,} jobs of one user waiting"]
        line = (f"under --policy {args.policy} with {args.pending:,} waiting: a tick {1e3 * queued:.1f} ms, "
                f"{1e3 * moved:.1f} ms after a submission (goal < 20 ms: "
                f"{'met' if max(queued, moved) < 0.020 else 'NOT met'}), the first tick {1e3 * first:.0f} ms")
        print(line)
        body += f"\n\n{markdown(ticks)}\n\n{line}"
    if disk is not None:
        Console().print(disk)
        body += f"\n\n{markdown(disk)}"
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "coordinator-history", body, stamp)


def policy_table(args: argparse.Namespace, found: dict[str, tuple[float, float, float]]) -> Table:
    """The ticks under ``--policy`` (its first, the median, the median after a submission) for each database."""
    table = Table(title=f"the tick under serve --policy {args.policy}: {os.cpu_count()} cores, "
                        f"load {os.getloadavg()[0]:.1f}")
    for column in ("database", "first tick ms", "tick ms", "tick after a submission ms"):
        table.add_column(column, justify="left" if column == "database" else "right")
    for name, (first, tick, moved) in found.items():
        table.add_row(name, f"{1e3 * first:.1f}", f"{1e3 * tick:.1f}", f"{1e3 * moved:.1f}")
    return table


def jobs_disk(tmp: Path, size_mb: int) -> Table | None:
    """What ``serve --jobs-disk-mb`` costs (root with loop devices; else None): making its image and mounting it
    (a first start), mounting it again (a restart) and unmounting it (a stop), median of 3; and ``serve --paused``
    to its first answer with the option (the image made by an earlier start) and without it."""
    if os.geteuid() != 0 or size_mb <= 0:
        return None
    from deeppool.coordinator.jobsdisk import mount_jobs_disk, unmount_jobs_disk

    made, again, gone = [], [], []
    for n in range(3):
        db = tmp / f"disk-{n}.db"
        Store(db).close()
        folder = default_log_dir(db)  # where serve on it mounts its jobs' disk
        folder.mkdir(parents=True)
        disk = mount_jobs_disk(folder, db, size_mb)
        if not disk.mounted:
            print(f"--jobs-disk-mb not measured: {disk.detail}")
            return None
        made.append(disk.seconds)
        began = time.perf_counter()
        unmount_jobs_disk(disk)
        gone.append(time.perf_counter() - began)
        disk = mount_jobs_disk(folder, db, size_mb)
        again.append(disk.seconds)
        unmount_jobs_disk(disk)
    db, starts = tmp / "disk-0.db", {}
    for name, options in (("with", ("--jobs-disk-mb", str(size_mb))), ("without", ())):
        began = time.perf_counter()
        proc = serve(REPO, db, free_port(), options)
        starts[name] = time.perf_counter() - began
        proc.terminate()
        proc.wait(10)
    table = Table(title=f"serve --jobs-disk-mb {size_mb}: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    table.add_column("step")
    table.add_column("s", justify="right")
    table.add_row("make the image (fallocate, mkfs.ext4) and mount it: a first start",
                  f"{statistics.median(made):.3f}")
    table.add_row("mount it again: a restart", f"{statistics.median(again):.3f}")
    table.add_row("unmount it: a stop", f"{statistics.median(gone):.3f}")
    table.add_row("serve --paused to first answer, the image mounted again", f"{starts['with']:.2f}")
    table.add_row("serve --paused to first answer, without the option", f"{starts['without']:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--bodies", type=int, default=4)
    parser.add_argument("--body-mb", type=int, default=200)
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose deeppool serves")
    parser.add_argument("--history", type=int, default=0,
                        help="instead: ticks, /metrics and start with this many finished jobs against none")
    parser.add_argument("--pending", type=int, default=50_000, help="with --history: also one user's waiting jobs")
    parser.add_argument("--policy", default="pollux",
                        help=f"with --history: also time the ticks under this serve --policy (besides "
                             f"{DEFAULT_POLICY}; empty: not)")
    parser.add_argument("--jobs-disk-mb", type=int, default=1024,
                        help="with --history, as root: also what serve --jobs-disk-mb costs with this size (0: not)")
    parser.add_argument("--write-docs", action="store_true",
                        help="with --history: write the table into docs/performance.md (coordinator-history)")
    args = parser.parse_args()
    if args.history:
        history(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        db, port = Path(tmp) / "bench.db", free_port()
        token = build(db, args.events)
        server = serve(args.code.resolve(), db, port)
        try:
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                                timeout=120)
            times = {path: timed(http, path) for path in ("/", "/v1/jobs", "/v1/jobs/1")}
            before = peak_rss_mb(server.pid)
            clients = [threading.Thread(target=flood, args=(port, args.body_mb)) for _ in range(args.bodies)]
            started = time.perf_counter()
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            flooded = time.perf_counter() - started
            after = peak_rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(10)
    table = Table(title=f"coordinator limits ({args.code}): {args.events:,} events on job 1, "
                        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for path, seconds in times.items():
        table.add_row(f"GET {path} (median of 5)", f"{1e3 * seconds:,.1f} ms")
    table.add_row("server peak RSS before the bodies", f"{before:,.0f} MB")
    table.add_row(f"server peak RSS after {args.bodies} x {args.body_mb} MB bodies, no token", f"{after:,.0f} MB")
    table.add_row("time to send (or be refused) all bodies", f"{flooded:.1f} s")
    Console().print(table)


if __name__ == "__main__":
    main()
