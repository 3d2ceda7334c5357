"""Metrics, their files, and the plots' utilisation series, on runs with fake Plan facts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import Simulation
from deeppool.cluster_sim.metrics import compare, measure, write_metrics
from deeppool.cluster_sim.plots import binned, utilisation_series, write_plots
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.policies import POLICIES

from .fakes import fake_facts, make_job

CLUSTER = ClusterSpec(gpus=8, gpus_per_node=4)


def results():
    jobs = [make_job(i, arrival=3 * i, gpus=(1, 2, 4, 8)[i % 4], iterations=80 + 10 * i, background=i % 4 == 0)
            for i in range(24)]
    return [Simulation(cluster=CLUSTER, jobs=jobs, policy=POLICIES[name], facts=fake_facts,
                       interference=InterferenceModel(), restart_penalty_s=0.0).run()
            for name in ("dp", "burst", "burst+bg")]


def test_metrics_follow_their_definitions() -> None:
    run = results()[0]
    m = measure(run)
    jct = np.array([r.jct_s for r in run.records])
    assert m.avg_jct_s == pytest.approx(jct.mean()) and m.p99_jct_s == pytest.approx(np.percentile(jct, 99))
    assert m.makespan_s == pytest.approx(max(r.finish_s for r in run.records))
    assert m.gpu_utilization == pytest.approx(run.busy_gpu_s / (8 * m.makespan_s))
    work = sum(r.work_gpu_s for r in run.records)
    assert m.fg_throughput + m.bg_throughput == pytest.approx(work / m.makespan_s)
    assert m.fg_jobs + m.bg_jobs == 24 and m.bg_jobs == 6


def test_throughput_relative_to_dp_and_files(tmp_path) -> None:
    metrics = compare(results())
    by_name = {m.policy: m for m in metrics}
    assert by_name["dp"].cluster_throughput_vs_dp == 1.0
    assert by_name["burst"].cluster_throughput_vs_dp == pytest.approx(
        by_name["dp"].makespan_s / by_name["burst"].makespan_s)
    write_metrics(metrics, tmp_path)
    payload = json.loads((tmp_path / "metrics.json").read_text())
    assert set(payload) == {"dp", "burst", "burst+bg"}
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 4
    assert compare(results()[1:])[0].cluster_throughput_vs_dp is None  # no dp run, no ratio


def test_utilisation_series_integrates_to_the_busy_gpu_time(tmp_path) -> None:
    for run in results():
        centres, busy = utilisation_series(run, bins=50)
        width = run.makespan_s / 50
        assert (busy * width * CLUSTER.gpus).sum() == pytest.approx(run.busy_gpu_s, rel=1e-6)
        assert busy.max() <= 1 + 1e-9
        _, allocated = binned(run, 2, bins=50)
        assert np.all(allocated >= busy - 1e-9)  # a busy GPU is an allocated one
    runs = results()
    paths = write_plots(runs, compare(runs), tmp_path)
    assert [path.name for path in paths] == ["utilisation.png", "jct_cdf.png", "throughput.png"]
    assert all(path.stat().st_size > 1000 for path in paths)


GOLDEN = "golden_metrics.json"
VOLATILE = ("sim_wall_s", "events_per_s")


def stable(metrics) -> dict[str, dict[str, object]]:
    from dataclasses import asdict

    return {m.policy: {k: v for k, v in asdict(m).items() if k not in VOLATILE} for m in metrics}


def test_golden_metrics_table(data_dir) -> None:
    """The fake-facts run's metrics, to the last digit; regenerate with `python -m tests.cluster_sim.test_metrics`."""
    expected = json.loads((data_dir / GOLDEN).read_text())
    got = stable(compare(results()))
    assert got.keys() == expected.keys()
    for policy, values in expected.items():
        assert got[policy].keys() == values.keys(), policy
        for key, value in values.items():
            exact = isinstance(value, str) or value is None
            want = value if exact else pytest.approx(value, rel=1e-12)
            assert got[policy][key] == want, (policy, key)


if __name__ == "__main__":
    from pathlib import Path

    target = Path(__file__).parent / "data" / GOLDEN
    target.write_text(json.dumps(stable(compare(results())), indent=2) + "\n")
    print(f"wrote {target}")
