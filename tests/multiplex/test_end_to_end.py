"""End to end on real processes: the planner's plan of a model no other test uses, a background on its idle rank.

``deeppool plan examples/dlrm.py --gpus 2 --objective cluster``, measured on this machine (a local profile,
as a user without a GPU model plans), puts every layer on one GPU: the DLRM's embedding tables make data
parallel on two ranks about twice as slow as on one (their gradients are all-reduced every iteration), so
the cluster's throughput is higher with the other GPU lent. That leaves rank 1 idle for the whole
iteration: a lendable GPU. ``deeppool run --background --mux gate`` must measure that idle time (about one
foreground iteration per iteration, not ~0) and train the background in it. The goal (at least 30% of the
idle rank-time recovered, the foreground slowed at most 10%) is checked where the machine is not
oversubscribed: with more runnable processes than cores, the background, which runs under ``SCHED_IDLE``,
gets only what the other processes leave, and both sides' times measure the other tenants.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deeppool.executor.engine.program import whole_idle_ranks
from deeppool.multiplex.metrics import net_gain
from deeppool.plans import Plan
from tests.entry import deeppool
from tests.multiplex.plans import BACKGROUND, REPO

pytestmark = pytest.mark.slow

DLRM = REPO / "examples" / "dlrm.py"
SLOWDOWN_NOISE = 0.05
"""Allowance over the 10% goal for the A/B slowdown's noise (a median of 9 shared over a median of 9 alone
iterations). Repeated `benchmarks/multiplex.py` runs on this 2-core machine spread by about ±4 points at a
load average below 2 (gate: +0.6%, +6.6%, -1.7%) and by ±9 points at 14-16 (+10.1%, +1.3%, +19.4%), where
the goal is not checked."""
QUIET_EXTRA_LOAD = 1.5
"""What the run itself adds to the load average: rank 0 busy, rank 1 waiting, the background when it may."""


@pytest.mark.heavy  # 21 s: tests/coordinator/test_end_to_end.py runs a burst job hosting a background job
def test_a_background_trains_on_the_idle_rank_of_the_planners_plan(tmp_path: Path, capfd) -> None:
    """The planner lends rank 1 whole where its profile finds the two cores slowing each other; where they did
    not at the plan (CI once), data parallel wins the cluster objective, and the same layout is pinned."""
    plan_path = tmp_path / "plan.json"
    args = ["plan", str(DLRM), "--gpus", "2", "--batch", "256", "--device-model", "local", "--cache-dir",
            str(tmp_path / "cache"), "--objective", "cluster", "--out", str(plan_path)]
    planned = deeppool(capfd, *args)
    assert planned.code == 0, planned.stderr[-2000:]
    assert "network: this host's, measured now with 2 gloo processes" in planned.stdout, "no --network-file: probed"
    if not whole_idle_ranks(Plan.load(plan_path)):
        planned = deeppool(capfd, *args, "--pin", "*=1")
        assert planned.code == 0, planned.stderr[-2000:]
        assert "network: this host's, measured earlier" in planned.stdout, "the probe's network is kept"
    plan = Plan.load(plan_path)
    assert whole_idle_ranks(plan) == (1,)
    out = tmp_path / "run"
    load_before = os.getloadavg()[0]
    ran = deeppool(capfd, "run", str(plan_path), "--nproc", "2", "--steps", "27", "--background", str(BACKGROUND),
                   "--mux", "gate", "--out", str(out))
    load_after = os.getloadavg()[0]
    assert ran.code == 0, ran.stderr[-3000:]
    mux = json.loads((out / "summary.json").read_text())["multiplex"]
    # rank 1's one window is the whole iteration, measured (it ends when rank 0's iteration does), not ~0 as
    # before; it opens only once rank 1 is scheduled again after the previous mark, which on an oversubscribed
    # machine (load 15-18 on 2 cores) left it below 0.8 of the iteration in one of three runs; and the marks
    # are a rank-0 iteration plus rank 0's work between iterations (checkpoints, progress) apart
    assert 0.5 * mux["fg_alone_ms"] <= mux["idle_rank_ms_per_iteration"] <= 1.25 * mux["fg_alone_ms"]
    assert 0 < mux["recovered_fraction"] <= 1
    assert mux["bg_steps"] > 0 and mux["bg_errors"] == []
    assert mux["net_gain"] == pytest.approx(net_gain(2, mux["fg_alone_ms"], mux["fg_shared_ms"],
                                                     mux["idle_rank_ms_per_iteration"], mux["bg_ms_per_iteration"]))
    assert "recovered" in ran.stdout and "net gain" in ran.stdout
    cores = os.cpu_count() or 1
    if load_before <= cores and load_after <= cores + QUIET_EXTRA_LOAD:
        assert mux["recovered_fraction"] >= 0.30, mux
        assert mux["fg_slowdown"] <= 0.10 + SLOWDOWN_NOISE, mux
        assert mux["net_gain"] > 1.0, mux
