"""Coordinator limits: the status page and list routes with 200k events, and memory under oversized bodies.

    python benchmarks/coordinator_limits.py [--events 200000] [--bodies 4] [--body-mb 200] [--code DIR]

Builds a database with 50 jobs, one of which has ``--events`` events (what a
job writing that many lines to its ``events.jsonl`` left in the database
before the per-job cap), starts ``deeppool serve --paused`` on it, and times
``GET /``, ``GET /v1/jobs`` and ``GET /v1/jobs/1`` (median of 5). Then
``--bodies`` clients at once send a ``--body-mb`` MB body without a token and
the server's peak resident memory (``VmHWM``) is read from ``/proc``.
``--code`` runs the server from another checkout of deeppool (to measure the
code before a change: ``git archive BASE deeppool | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import os
import socket
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

from deeppool.coordinator.jobs import JobKind, JobRequest
from deeppool.coordinator.store import Store

REPO = Path(__file__).resolve().parents[1]


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


def serve(code: Path, db: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "deeppool.cli", "serve", "--db", str(db), "--port", str(port),
                             "--gpus", "2", "--paused"], cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
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


def timed(http: httpx.Client, path: str) -> float:
    times = []
    for _ in range(5):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--bodies", type=int, default=4)
    parser.add_argument("--body-mb", type=int, default=200)
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose deeppool serves")
    args = parser.parse_args()
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
