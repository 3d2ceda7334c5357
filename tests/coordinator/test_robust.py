"""The coordinator survives what jobs write and what operators do: real processes, a real server.

A job's damaged progress, events and exit files never stop the scheduler; its events and log are capped; a
failing scheduling loop is retried and reported by ``/healthz``; the server starts whatever a job left
behind; ``serve`` refuses a damaged database, a second server on one database and a port in use with one
line each, creating nothing, and says when it starts and stops.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deeppool.coordinator.driver import DriverSteps
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.runtime import JobLimits, Runtime
from deeppool.coordinator.store import Store
from tests.coordinator.test_durability import REPO, start
from tests.coordinator.test_runtime import python, settle
from tests.entry import Result, deeppool
from tests.net import free_port

pytestmark = pytest.mark.slow
HOSTILE = """
import json, pathlib, time
run = pathlib.Path({run!r})
run.mkdir(parents=True, exist_ok=True)
(run / "progress.json").write_text('{{"steps_done": 1e400, "steps": 10}}')
lines = ['{{"message": "event %d"}}' % n for n in range(2000)]
lines[3] = '[' * 100000
lines[4] = '{{"message": "\\\\ud800 lone"}}'
lines[5] = '{{"message": 1e400}}'
(run / "events.jsonl").write_text("\\n".join(lines) + "\\n")
print("up", flush=True)
time.sleep(60)
"""


def runtime(tmp_path: Path, steps: list[list[str]], limits: JobLimits) -> Runtime:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    return Runtime(store, LocalLauncher(tmp_path / "jobs"), lambda job, attempt, guests: steps, grace_s=0.5,
                   limits=limits)


def background(store: Store) -> int:
    job, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))
    return job.id


def test_hostile_job_files_are_read_defensively_and_events_are_capped(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python(HOSTILE.format(run=str(tmp_path / "jobs" / "job-1" / "run")))],
                 JobLimits(max_events=50))
    job_id = background(rt.store)
    rt.start(rt.store.job(job_id), "granted")
    running = settle(rt, job_id, lambda j: j.state is JobStatus.RUNNING and len(rt.store.events(job_id)) > 3)
    for _ in range(3):
        rt.reconcile()  # again and again: nothing raises, nothing is added twice
    notes = [e.reason for e in rt.store.events(job_id) if e.from_state is e.to_state]
    assert running.progress == 0.0  # 1e400 steps done is no progress at all
    assert len(notes) == 50 and notes[0] == "attempt 1: event 0"
    assert notes[4] == "attempt 1: ? lone"  # a lone surrogate, which SQLite cannot store, replaced
    assert notes[-1] == "attempt 1: later events are not recorded: a job keeps at most 50 (serve --max-events)"
    rt.launcher.stop(job_id, 1, 0.5)


def test_a_job_whose_log_passes_its_cap_is_told_and_stopped(tmp_path: Path) -> None:
    chatty = python("import sys\nprint('up', flush=True)\nwhile True: sys.stdout.write('x' * 4095 + '\\n')")
    rt = runtime(tmp_path, [chatty], JobLimits(max_log_bytes=1 << 20))
    job_id = background(rt.store)
    rt.start(rt.store.job(job_id), "granted")
    stopped = settle(rt, job_id, lambda j: j.state.terminal)
    assert stopped.state is JobStatus.FAILED and "log passed the cap of 1048576 bytes" in stopped.reason
    log = rt.launcher.files(job_id, 1).log
    deadline = time.monotonic() + 10
    while rt.launcher.observe(job_id, 1).phase.value == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rt.launcher.observe(job_id, 1).phase.value != "running"  # its processes are gone
    assert log.read_text()[-300:].endswith("the job was stopped\n")


def test_the_supervisor_stops_writing_a_log_at_its_cap(tmp_path: Path) -> None:
    """Issue 44, failure 7: the cap was checked once a tick, and a log reached 157 MB past a 5 MB cap."""
    cap = 1 << 20
    flood = python("import os\nos.write(1, b'up\\n')\nwhile True: os.write(1, b'x' * (1 << 20))")
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    rt = Runtime(store, LocalLauncher(tmp_path / "jobs", max_log_bytes=cap), lambda job, attempt, guests: [flood],
                 grace_s=0.5, limits=JobLimits(max_log_bytes=cap))
    job_id = background(store)
    rt.start(store.job(job_id), "granted")
    log = rt.launcher.files(job_id, 1).log
    deadline = time.monotonic() + 30
    try:
        while rt.launcher.observe(job_id, 1).phase.value != "exited" and time.monotonic() < deadline:
            assert log.stat().st_size <= cap + 200 if log.exists() else True  # never past it, even between ticks
            time.sleep(0.01)
    finally:
        rt.launcher.stop(job_id, 1, 0.5)  # a failed check leaves no flood behind
    stopped = settle(rt, job_id, lambda j: j.state.terminal)
    assert stopped.state is JobStatus.FAILED, stopped
    assert stopped.reason == f"its log passed the cap of {cap} bytes (serve --max-log-mb): stopped"
    assert cap < log.stat().st_size <= cap + 200
    assert log.read_bytes().endswith(b"the job was stopped\n")


def left_behind(db: Path) -> None:
    """A job RUNNING in the database whose supervisor left a damaged exit file and hostile run files."""
    store = Store(db)
    store.create_token("alice")
    job_id = background(store)
    for state in (JobStatus.STARTING, JobStatus.RUNNING):
        store.transition(job_id, state, "as the last server left it")
    store.close()
    logs = db.parent / "logs"
    run = logs / f"job-{job_id}" / "run"
    run.mkdir(parents=True)
    (logs / f"job-{job_id}.1.pid").write_text("999999999\n")
    (logs / f"job-{job_id}.1.exit").write_text("99999999999999999999999\n")  # past SQLite's INTEGER
    (run / "progress.json").write_text('{"steps_done": 1e400, "steps": 1e400}')
    (run / "events.jsonl").write_text('{"message": "\\ud800"}\n' + "[" * 50_000 + "\n")


def test_the_server_starts_whatever_a_job_left_behind(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    left_behind(db)
    server = start(db, port, paused=True, logs=db.parent / "logs", job_user=False)  # paused: no job runs
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json() == {"ok": True}
    finally:
        server.terminate()
        server.wait(10)
    job = Store(db).job(1)
    assert job.state is JobStatus.FAILED and job.reason == "its exit file is damaged" and job.exit_code is None


def test_a_failing_scheduling_loop_is_retried_and_healthz_says_so(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    store = Store(db)
    store.create_token("alice")
    job_id = background(store)
    for state in (JobStatus.STARTING, JobStatus.RUNNING):
        store.transition(job_id, state, "running")
    store.close()
    # a live process that looks like the job's supervisor: every tick relays the job's events (a write)
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                   "deeppool.coordinator.supervisor"])
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / f"job-{job_id}.1.pid").write_text(f"{supervisor.pid}\n")
    server = start(db, port, paused=True)
    try:
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # hold the write lock: the loop's next write fails after 5 s
        health = wait_for(port, lambda h: h.status_code == 503, 30)
        assert health.json()["ok"] is False and "database is locked" in health.json()["detail"]
        blocker.execute("ROLLBACK")
        blocker.close()
        assert wait_for(port, lambda h: h.status_code == 200, 30).json() == {"ok": True}
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=20)
        supervisor.kill()
        supervisor.wait()
    lines = stderr.decode().splitlines()
    assert any("the scheduling loop failed; retrying" in line for line in lines)
    assert any("the scheduling loop runs again" in line for line in lines)
    assert lines[0].startswith("deeppool serve: http://127.0.0.1:") and "policy fifo-backfill" in lines[0]
    assert lines[-2].startswith("deeppool serve: stopped by SIGINT") and lines[-1] == "interrupted"
    assert server.returncode == 130  # Ctrl-C: stopped cleanly, and said so (docs/executor.md, Ctrl-C)


def test_a_request_stalled_in_its_body_does_not_hold_serve_past_ctrl_c(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    Store(db).close()
    server = start(db, port, paused=True)
    try:
        wait_for(port, lambda h: h.status_code == 200, 30)
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"kind\"")  # a body that never comes
        time.sleep(0.5)
        began = time.monotonic()
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=20)
        took = time.monotonic() - began
        stalled.close()
    finally:
        server.kill()
    lines = stderr.decode().splitlines()
    assert lines[-2].startswith("deeppool serve: stopped by SIGINT") and lines[-1] == "interrupted", lines
    assert server.returncode == 130 and took < 5, (server.returncode, took)


def wait_for(port: int, done, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"http://127.0.0.1:{port}/healthz")
        if done(health):
            return health
        time.sleep(0.2)
    raise AssertionError(f"healthz stayed {health.status_code}: {health.text}")


def serve(capsys: pytest.CaptureFixture[str], db: Path, port: int) -> Result:
    """``deeppool serve`` in this process: each case here is refused before it would serve."""
    return deeppool(capsys, "serve", "--db", str(db), "--port", str(port), "--gpus", "2", "--allow",
                    str(REPO / "examples"), "--paused")  # paused: as root, no --job-user is needed


def test_serve_refuses_a_damaged_database_a_second_server_and_a_port_in_use_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "damaged.db"
    store = Store(damaged)
    store.create_token("alice")
    for _ in range(300):
        background(store)
    store.close()
    with damaged.open("r+b") as raw:
        raw.seek(2 * 4096)
        raw.write(bytes(3 * 4096))  # three zeroed pages
    refused = serve(capsys, damaged, free_port())
    assert refused.code == 2 and refused.stderr.startswith("error: --db") and "damaged" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1
    db, port = tmp_path / "deeppool.db", free_port()
    first = start(db, port, paused=True)
    try:
        second = serve(capsys, db, free_port())
        assert second.code == 2 and len(second.stderr.splitlines()) == 1
        assert second.stderr.startswith(f"error: --db '{db}' is in use by another server (pid {first.pid})")
        busy = serve(capsys, tmp_path / "other.db", port)
        assert busy.code == 2 and len(busy.stderr.splitlines()) == 1
        assert busy.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port} (Address already in use)")
        assert not list(tmp_path.glob("other.db*"))  # nothing was created
    finally:
        first.terminate()
        first.wait(10)
    assert Store(db).integrity() == "ok"


def test_a_factory_jobs_inputs_reach_the_planner_and_the_run(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="tests.models.token_factory:tiny_lm",
                                              gpus=1, batch=4, steps=2, input_shape=(16,), input_dtype="int64",
                                              vocab_size=64))
    [argv] = DriverSteps(folder=tmp_path / "logs")(job, 1, [])
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = json.loads((tmp_path / "logs" / f"job-{job.id}" / "plan.json").read_text())
    assert plan["model"]["source"] == "factory"
    assert (plan["model"]["input_shape"], plan["model"]["input_dtype"], plan["model"]["vocab_size"]) == ([16], "int64",
                                                                                                         64)
    summary = json.loads((tmp_path / "logs" / f"job-{job.id}" / "summary.json").read_text())
    assert len(summary["losses"]) == 2


def test_the_cut_notice_is_stored_when_a_job_reaches_exactly_the_cap() -> None:
    from deeppool.coordinator.runtime import capped

    limit = 3
    lists = [capped([f"m{i}" for i in range(n)], limit) for n in range(1, 7)]
    for shorter, longer in zip(lists, lists[1:]):
        assert longer[:len(shorter)] == shorter, "each list must be a prefix of the next (Store.note keeps prefixes)"
    assert lists[-1] == ["m0", "m1", lists[-1][-1]] and "later events are not recorded" in lists[-1][-1]


def test_an_idempotency_key_reused_with_another_script_is_a_conflict(tmp_path: Path) -> None:
    from deeppool.coordinator.jobs import differences

    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    first = JobRequest(kind=JobKind.FOREGROUND, model="m.py", gpus=2, batch=8, steps=5, script="a.py")
    job, _ = store.submit("alice", first)
    assert differences(job, first) == []
    assert differences(job, first.model_copy(update={"script": "b.py"})) == ["script: 'a.py' there, 'b.py' here"]
