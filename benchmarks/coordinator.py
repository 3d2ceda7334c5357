"""Coordinator load: sustained submissions per second through the real server, with latency percentiles.

    python benchmarks/coordinator.py [--seconds 10] [--clients 8]

Starts ``deeppool serve`` (uvicorn, one worker, SQLite in WAL mode with
``synchronous=FULL``: every acknowledged submission is on disk), then runs
``--clients`` threads that submit foreground jobs for ``--seconds`` seconds,
each with its own idempotency key. The baseline in the same run is
``GET /healthz`` under the same load, which costs the HTTP stack but no
database write. The server runs ``--paused``: it queues the jobs and
launches none, so the benchmark measures the API and the database alone. Goal: at least 200
submissions/s sustained.
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

from deeppool.docregions import Stamp, markdown, write_region

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(db: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "deeppool.cli", "serve", "--db", str(db), "--port", str(port),
                             "--gpus", "2", "--paused", "--jobs-disk-mb", "0", "--max-pending", "0",
                             "--max-submits-per-minute", "0"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the server, not quotas
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("the server did not start")


def load(port: int, token: str, seconds: float, clients: int, submit: bool) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(n: int) -> None:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"})
        mine, i = [], 0
        while time.monotonic() < stop:
            start = time.perf_counter()
            if submit:
                response = http.post("/v1/jobs", json={"kind": "fg", "gpus": 2, "batch": 64, "model": "bench.mlp:model",
                                                       "input_shape": [16], "idempotency_key": f"c{n}-{i}"})
                assert response.status_code == 201, response.text
            else:
                http.get("/healthz").raise_for_status()
            mine.append(time.perf_counter() - start)
            i += 1
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def row(table: Table, name: str, latencies: list[float], seconds: float) -> float:
    rate = len(latencies) / seconds
    q = statistics.quantiles(latencies, n=100)
    table.add_row(name, f"{len(latencies):,}", f"{rate:,.0f}", f"{1e3 * statistics.median(latencies):.1f}",
                  f"{1e3 * q[98]:.1f}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'coordinator')")
    args = parser.parse_args()
    stamp = Stamp.started()
    with tempfile.TemporaryDirectory() as tmp:
        db, port = Path(tmp) / "bench.db", free_port()
        token = subprocess.run([sys.executable, "-m", "deeppool.cli", "token", "create", "bench", "--db", str(db)],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        server = serve(db, port)
        try:
            load(port, token, 1.0, args.clients, submit=False)  # warm up
            health = load(port, token, args.seconds, args.clients, submit=False)
            submits = load(port, token, args.seconds, args.clients, submit=True)
        finally:
            server.terminate()
            server.wait(10)
    table = Table(title=f"coordinator load: {args.clients} clients, {args.seconds:g} s each, "
                        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    for column in ("request", "done", "per second", "p50 ms", "p99 ms"):
        table.add_column(column, justify="left" if column == "request" else "right")
    baseline = row(table, "GET /healthz (baseline)", health, args.seconds)
    rate = row(table, "POST /v1/jobs (durable)", submits, args.seconds)
    Console().print(table)
    verdict = f"submissions/s over the baseline: {rate / baseline:.2f}; goal >= 200/s: {'met' if rate >= 200 else 'NOT met'}"
    print(verdict)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "coordinator", f"{markdown(table)}\n\n{verdict}", stamp)


if __name__ == "__main__":
    main()
