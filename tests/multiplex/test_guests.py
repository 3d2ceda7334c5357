"""Guests that join and leave a running host's rank: the control file, the reports, and a real guest process."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from deeppool.executor.engine.idle import IdleWindowEvent
from deeppool.multiplex.guests import (
    GuestLender,
    GuestLoan,
    GuestReport,
    GuestsConfig,
    GuestState,
    loans_json,
    parse_loans,
    report_path,
)
from deeppool.plans import Plan
from tests.multiplex.plans import BACKGROUND, burst_plan
from tests.multiplex.test_processes import alive

RUNNER = "deeppool.coordinator.guest"


def loan(folder: Path, job_id: int, steps: int) -> GuestLoan:
    return GuestLoan(job_id=job_id, ranks=(1,), model=str(BACKGROUND), batch=8, steps=steps, folder=folder)


def test_a_control_file_round_trips_and_a_torn_one_is_not_read(tmp_path: Path) -> None:
    loans = [loan(tmp_path / "job-3", 3, 20), GuestLoan(job_id=2, ranks=(0, 1), model="m.py", batch=4, steps=7,
                                                        folder=tmp_path / "job-2", roots=(tmp_path,))]
    data = loans_json(loans)
    assert parse_loans(data) == {2: loans[1], 3: loans[0]}
    assert parse_loans(data[:len(data) // 2]) is None  # caught half-written: read at a later boundary
    assert parse_loans(b'{"loans": [{"job_id": 1, "ranks": [], "model": "m", "batch": 1, "steps": 1, '
                       b'"folder": "f"}]}') is None  # a loan of no ranks is no loan


@pytest.mark.parametrize("data", [None, [], {"state": "done", "steps": 1}, {"state": "finished", "steps": -1},
                                  {"state": "finished", "steps": True}, {"state": "finished", "steps": 1.5}])
def test_a_malformed_report_says_nothing(data: object) -> None:
    assert GuestReport.parse(1, 0, data) is None


def test_a_wellformed_report_is_taken_and_its_error_cut() -> None:
    report = GuestReport.parse(4, 1, {"state": "failed", "steps": 3, "error": "x" * 900})
    assert report is not None and report.state is GuestState.FAILED and report.steps == 3
    assert report.error == "x" * 500


class OneRank:
    """A one-rank :class:`~deeppool.executor.engine.comm.Comm`'s gather: this rank's object, on rank 0."""

    def gather(self, obj: object) -> list[object]:
        return [obj]


@pytest.fixture(scope="module")
def plan() -> Plan:
    return burst_plan()


class Host:
    """Rank 1 of the burst plan, stepped by hand: each step opens and closes its idle windows."""

    def __init__(self, tmp_path: Path, plan: Plan) -> None:
        self.plan = plan
        self.control = tmp_path / "job-1.1.guests.json"
        self.out = tmp_path / "run"
        self.lender = GuestLender(self.plan, GuestsConfig(control=self.control, runner=RUNNER), rank=1,
                                  out_dir=self.out)
        self.step = 0

    def lend(self, *loans: GuestLoan) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_bytes(loans_json(loans))
        tmp.replace(self.control)

    def run_until(self, done: Callable[[], bool], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"step {self.step}: {self.lender.reports}"
            start = time.perf_counter()
            for window in self.plan.idle_windows(1):
                opened = time.perf_counter()
                event = IdleWindowEvent(rank=1, step=self.step, window=window, opened_at_s=opened,
                                        iteration_start_s=start)
                self.lender.opened(event)
                time.sleep(0.01)
                self.lender.closed(event, time.perf_counter())
            self.step += 1

    def report(self, job_id: int) -> dict:
        path = report_path(self.out, job_id, 1)
        return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.slow
def test_a_guest_joins_a_running_rank_and_finishes_and_one_taken_back_leaves(tmp_path: Path, plan: Plan) -> None:
    host = Host(tmp_path, plan)
    host.run_until(lambda: host.step >= 2)  # running before any loan
    host.lend(loan(tmp_path / "job-2", 2, 3))
    host.run_until(lambda: host.report(2).get("state") == "finished")
    assert host.report(2) == {"job_id": 2, "rank": 1, "state": "finished", "steps": 3, "error": None}
    assert (tmp_path / "job-2" / "background" / "background-rank0.pt").exists()  # its own folder, replica 0
    assert 2 not in host.lender.runs

    host.lend(loan(tmp_path / "job-2", 2, 3), loan(tmp_path / "job-3", 3, 1_000_000))
    host.run_until(lambda: 3 in host.lender.runs)
    pid = host.lender.runs[3].background.pid
    host.lend(loan(tmp_path / "job-2", 2, 3))  # job 3's loan is taken back (cancelled, preempted)
    host.run_until(lambda: host.report(3).get("state") == "left")
    assert not alive(pid) and 3 not in host.lender.runs
    assert 2 not in host.lender.runs  # a finished guest is not started again while its loan stands
    host.lender.stop()
    assert {(r.job_id, r.state) for r in host.lender.reports} == {(2, GuestState.FINISHED), (3, GuestState.LEFT)}
    section = host.lender.gather(OneRank(), [])  # rank 0's summary.json section, and its lines in the log
    assert sorted((item["job_id"], item["state"]) for item in section["guests"]) == [(2, "finished"), (3, "left")]
    console = Console(record=True, width=200)
    host.lender.show(console)
    assert "guest job 2 on rank 1: finished at step 3" in console.export_text()


@pytest.mark.slow
def test_a_guest_whose_model_is_refused_fails_and_its_host_trains_on(tmp_path: Path, plan: Plan) -> None:
    host = Host(tmp_path, plan)
    refused = GuestLoan(job_id=4, ranks=(1,), model=str(BACKGROUND), batch=8, steps=3, folder=tmp_path / "job-4",
                        roots=(tmp_path / "elsewhere",))
    host.lend(refused)
    host.run_until(lambda: host.report(4).get("state") == "failed")
    assert "outside the server's allowed roots" in host.report(4)["error"]
    step = host.step
    host.run_until(lambda: host.step >= step + 3)  # not started again while its loan stands
    assert 4 not in host.lender.runs and [r.state for r in host.lender.reports] == [GuestState.FAILED]
