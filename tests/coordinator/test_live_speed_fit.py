"""The live speed fit from two widths: a job measured on 2 GPUs, resized to 1 and measured there, is fitted by
the coordinator (its Elastic view, what the policy decides by) to both points (``adaptation/goodput.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from deeppool.adaptation.goodput import IterationFit
from deeppool.coordinator.jobs import JobStatus
from deeppool.coordinator.store import Store
from deeppool.scheduling import POLICIES, Decision, PlanMode, Snapshot, Start
from tests.coordinator.test_elastic import Cluster, _submit

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # real ranks, a resize: about 2 minutes on 2 busy cores


@dataclass
class ResizeOnceMeasured:
    """FIFO with backfilling, and job ``job_id`` moved to ``to_gpus`` once the coordinator has a speed point
    of it on the GPUs it started on (read from the store the server writes)."""

    job_id: int
    to_gpus: int
    store: Store
    name: str = "resize-once-measured"

    def decide(self, snap: Snapshot) -> Decision:
        held = snap.holding.get(self.job_id)
        ready = held is not None and held != self.to_gpus and snap.adaptive.get(self.job_id) is not None
        if ready and any(p.gpus == held for p in self.store.speeds([self.job_id])[self.job_id]):
            return Decision(preempt=(self.job_id,), start=(Start(job_id=self.job_id, gpus=self.to_gpus,
                                                                 mode=PlanMode.BURST),))
        return POLICIES["fifo-backfill"].decide(snap)


def test_a_job_measured_at_two_widths_is_fitted_to_both(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    job_id = _submit(store, 2, 150)
    store.close()
    watcher = Store(tmp_path / "deeppool.db")
    cluster = Cluster.make(tmp_path, ResizeOnceMeasured(job_id=job_id, to_gpus=1, store=watcher), gpus=2)
    elastic = cluster.service.elastic
    assert elastic is not None

    def measured_on_both() -> bool:
        return {p.gpus for p in cluster.store.speeds([job_id])[job_id]} == {1, 2}

    cluster.run_until(lambda: measured_on_both() or cluster.store.job(job_id).state.terminal, timeout_s=600)
    events = [e.reason for e in cluster.store.events(job_id)]
    assert measured_on_both(), events
    assert [(c.from_gpus, c.to_gpus, c.phase) for c in cluster.store.resizes(job_id)] == [(2, 1, "DONE")], events
    job = cluster.store.job(job_id)
    points = {p.gpus: p for p in cluster.store.speeds([job_id])[job_id]}
    fit = elastic.view([job]).speeds[job_id].fit  # what the coordinator gives the policy
    # T(g, M) = alpha + beta * M / g through both measurements: M / g is 32 on 2 GPUs, 64 on 1
    t2, t1 = points[2].iteration_s, points[1].iteration_s
    beta = (t1 - t2) / (64 / 1 - 64 / 2)
    alpha = t2 - beta * 64 / 2
    if beta > 0 and alpha >= 0:  # the two points are consistent with the model: it goes through both
        assert math.isclose(fit.alpha, alpha, rel_tol=1e-9, abs_tol=1e-12) and math.isclose(fit.beta, beta)
        assert math.isclose(fit.iteration_s(2, 64), t2) and math.isclose(fit.iteration_s(1, 64), t1)
    else:  # busy cores made 1 GPU no slower (or more than twice as slow): the constrained least squares
        assert fit == IterationFit.fit([(2, 64, t2), (1, 64, t1)])
    if not math.isclose(t1, 2 * t2):  # a fit to either point alone would scale linearly from it
        assert fit not in (IterationFit.fit([(2, 64, t2)]), IterationFit.fit([(1, 64, t1)]))
    print(f"measured: {t2 * 1e3:.1f} ms on 2 GPUs, {t1 * 1e3:.1f} ms on 1; fitted alpha {fit.alpha * 1e3:.2f} ms, "
          f"beta {fit.beta * 1e3:.3f} ms/sample")
    if not cluster.store.job(job_id).state.terminal:
        cluster.store.transition(job_id, JobStatus.CANCELLED, "the test has what it needs")
        cluster.run_until(lambda: not any(j.state in (JobStatus.RUNNING, JobStatus.STARTING)
                                          for j in cluster.store.jobs()), timeout_s=120)
    watcher.close()
