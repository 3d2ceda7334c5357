"""Issue 44, item 2: idle connections that trickle a header line cannot take the server's descriptors.

A real server (``deeppool serve``) with a descriptor limit of 256 is attacked by another account holding up to
300 connections that each send a header line now and then (loopback only, bounded in count and time). Its
connections past ``--max-client-connections`` are answered 429 at once, the rest closed after
``--head-timeout-s``; meanwhile ``/healthz`` answers, a job that exits 0 is recorded SUCCEEDED, the server
never holds more descriptors than its limit, and its log says each condition once. A trickled head and a
stalled body are closed after their timeouts; a repeated condition is logged once, then counted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deeppool.coordinator.connections import Once
from tests.coordinator.accounts import JOB_ACCOUNT, can_make_accounts, job_folder
from tests.coordinator.test_durability import REPO, start, token
from tests.net import free_port

pytestmark = pytest.mark.slow
LIMIT = 256
"""The server's descriptor limit (soft and hard) in the test."""
ATTACK = r"""
import json, signal, socket, sys, time
port, count, limit_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
stats = {"opened": 0, "refused_429": 0, "closed_by_server": 0, "head_closed_after_s": [], "most_open": 0}
open_ = {}  # socket: when opened

def report(*_):
    stats["head_closed_after_s"] = sorted(stats["head_closed_after_s"])[:5] + sorted(stats["head_closed_after_s"])[-5:]
    print(json.dumps(stats), flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, report)
began = time.monotonic()
while time.monotonic() - began < limit_s:
    for _ in range(min(50, count - len(open_))):  # top up to `count`, at most 50 a round
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=2)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            conn.setblocking(False)
            open_[conn] = time.monotonic()
            stats["opened"] += 1
        except OSError:
            pass
    stats["most_open"] = max(stats["most_open"], len(open_))
    for conn, since in list(open_.items()):
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            try:
                conn.send(b"X-Trickle: 1\r\n")  # one more header line, never the end of the head
            except OSError:
                data = b""
            else:
                continue
        except OSError:
            data = b""
        if data.startswith(b"HTTP/1.1 429"):
            stats["refused_429"] += 1
        else:
            stats["closed_by_server"] += 1
            stats["head_closed_after_s"].append(round(time.monotonic() - since, 1))
        conn.close()
        del open_[conn]
    time.sleep(0.25)
report()
"""


def serve_limited(db: Path, port: int, *options: str) -> subprocess.Popen:
    """``deeppool serve`` (its jobs as the tests' job account) with a descriptor limit of :data:`LIMIT`, soft and
    hard: 300 idle connections would pass it."""
    server = subprocess.Popen(["prlimit", f"--nofile={LIMIT}:{LIMIT}", "--", sys.executable, "-m", "deeppool.cli",
                               "serve", "--db", str(db), "--port", str(port), "--gpus", "1", "--allow",
                               str(REPO / "examples"), "--job-user", JOB_ACCOUNT, "--log-dir", str(job_folder()),
                               *options], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.kill()
    raise AssertionError(f"server did not start: {server.stderr.read().decode()[-2000:]}")


def descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@pytest.mark.skipif(os.geteuid() != 0 or not can_make_accounts() or not shutil.which("prlimit"),
                    reason="the attacker must be another account than the prober (a connection cap is per account)")
def test_trickling_connections_of_one_account_leave_the_service_up_and_records_true(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    secret = token(db)
    server = serve_limited(db, port, "--max-client-connections", "20", "--head-timeout-s", "3")
    attacker = subprocess.Popen(["/usr/bin/python3", "-I", "-c", ATTACK, str(port), "300", "90"], user=JOB_ACCOUNT,
                                cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {secret}"},
                        timeout=5)
    slowest, most_fds, state, job = 0.0, 0, "", {}
    attack_began = time.monotonic()
    try:
        time.sleep(2)  # the attack is under way
        submitted = http.post("/v1/jobs", json={"kind": "fg", "gpus": 1, "batch": 8, "steps": 3,
                                                "model": str(REPO / "examples" / "background_mlp.py")})
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and attacker.poll() is None:
            began = time.monotonic()
            health = http.get("/healthz")
            slowest = max(slowest, time.monotonic() - began)
            assert health.status_code == 200, health.text
            most_fds = max(most_fds, descriptors(server.pid))
            job = http.get(f"/v1/jobs/{job_id}").json()
            state = job["state"]
            if state in ("SUCCEEDED", "FAILED", "CANCELLED") and time.monotonic() - attack_began > 10:
                break  # the job ended, and the attack ran at least 10 s
            time.sleep(0.5)
        assert attacker.poll() is None, "the attack ended before the job did"
        attacker.send_signal(signal.SIGTERM)
        out, _ = attacker.communicate(timeout=20)
    finally:
        attacker.kill()
        http.close()
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=20)
    stats = json.loads(out.decode().strip().splitlines()[-1])
    assert state == "SUCCEEDED" and job["exit_code"] == 0, (job, stderr.decode()[-3000:])  # its end recorded truly
    assert slowest < 2.0, slowest  # /healthz answered throughout
    assert most_fds < LIMIT, most_fds  # never out of descriptors
    assert stats["refused_429"] > 100, stats  # past the cap: answered at once
    assert stats["closed_by_server"] >= 20 and min(stats["head_closed_after_s"]) >= 2.5, stats  # head timeout
    assert max(stats["head_closed_after_s"]) < 8, stats  # ... and not much later
    lines = stderr.decode().splitlines()
    assert sum("refused a connection from uid" in line for line in lines) == 1, lines[:20]  # once, not per request
    assert sum("request head took over 3 s" in line for line in lines) == 1, lines[:20]
    assert len(lines) < 30, lines[:40]


def closed_after(port: int, head: bytes, *, trickle: bytes = b"", limit_s: float = 20) -> float:
    """Send ``head`` (then ``trickle`` every 0.3 s): the seconds until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as conn:
        began = time.monotonic()
        conn.sendall(head)
        conn.settimeout(0.3)
        while time.monotonic() - began < limit_s:
            try:
                if conn.recv(4096) == b"":
                    return time.monotonic() - began
            except TimeoutError:
                if trickle:
                    try:
                        conn.sendall(trickle)
                    except OSError:
                        return time.monotonic() - began
            except OSError:
                return time.monotonic() - began
    raise AssertionError(f"the connection stayed open for {limit_s} s")


def test_a_trickled_head_and_a_stalled_body_are_closed_and_logged_once(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    token(db)
    server = start(db, port, paused=True, job_user=False,
                   options=("--head-timeout-s", "1.5", "--body-timeout-s", "1.5"))
    try:
        for _ in range(2):
            took = closed_after(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", trickle=b"X-Trickle: 1\r\n")
            assert 1.2 < took < 5, took
        took = closed_after(port, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 1000\r\n\r\n{\"kind\"")  # a body that never comes
        assert 1.2 < took < 5, took
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=20)
    lines = stderr.decode().splitlines()
    assert sum("request head took over 1.5 s" in line for line in lines) == 1, lines  # twice, said once
    assert sum("request body stalled for over 1.5 s" in line for line in lines) == 1, lines


def test_a_condition_is_logged_once_then_counted() -> None:
    once = Once()
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource\n"
                               "socket: <fd=%d>", (7,), None)
    assert once.filter(record)
    again = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource\n"
                               "socket: <fd=%d>", (n,), None) for n in range(1000)]
    assert not any(once.filter(r) for r in again)  # within the minute: counted, not logged
    later = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource", (),
                              None)
    once._seen[("asyncio", "socket.accept() out of system resource", "")] = (time.monotonic() - 61, 1000)
    assert once.filter(later) and "[1001 times in the last 61 s]" in later.getMessage()
    assert once.filter(logging.LogRecord("other", logging.ERROR, __file__, 1, "another condition", (), None))
