"""``deeppool simulate`` end to end on small workloads, and its errors (exit 2, one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from deeppool.cluster_sim.cli import app

from .conftest import TRACES

REQUIRED = {"avg_jct_s", "p99_jct_s", "makespan_s", "gpu_utilization", "fg_throughput", "bg_throughput",
            "cluster_throughput_vs_dp"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def simulate(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_compare_policies_on_a_synthetic_workload(tmp_path, data_dir, cache) -> None:
    out = tmp_path / "results"
    result = simulate(
        "synthetic", "--gpus", "16", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
        "--policy", "burst", "--policy", "burst+bg", "--policy", "dp+bg", "--jobs", "40", "--arrival-rate", "60",
        "--median-duration", "600", "--size-mix", "1:0.5,4:0.3,8:0.2", "--out", str(out), "--cache-dir", str(cache),
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["dp", "burst", "burst+bg", "dp+bg"]
    for entry in metrics.values():
        assert REQUIRED <= set(entry) and entry["jobs"] == 40
    assert metrics["dp"]["cluster_throughput_vs_dp"] == 1.0
    assert metrics["burst"]["avg_jct_s"] <= metrics["dp"]["avg_jct_s"] * (1 + 1e-9)
    for name in ("metrics.csv", "jobs.csv", "run.json", "utilisation.png", "jct_cdf.png", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
    assert "burst+bg" in result.output and "vs dp" in result.output


def test_same_seed_same_metrics(tmp_path, data_dir, cache) -> None:
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        args = ("synthetic", "--gpus", "16", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
                "--jobs", "30", "--seed", "7", "--out", str(out), "--cache-dir", str(cache), "--no-plots")
        assert simulate(*args).exit_code == 0
        metrics = json.loads((out / "metrics.json").read_text())
        outputs.append({p: {k: v for k, v in m.items() if k not in ("sim_wall_s", "events_per_s")} for p, m in metrics.items()})
    assert outputs[0] == outputs[1]


def test_pollux_workload_file_with_a_mapping(tmp_path, data_dir, cache) -> None:
    out = tmp_path / "pollux"
    result = simulate(str(data_dir / "small_pollux.csv"), "--gpus", "8", "--gpus-per-node", "4", "--mapping",
                      str(data_dir / "mapping.json"), "--policy", "burst+bg", "--out", str(out),
                      "--cache-dir", str(cache), "--no-plots")
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["burst+bg"]["bg_jobs"] == 3 and metrics["burst+bg"]["fg_jobs"] == 3


@pytest.mark.slow
def test_pollux_policy_on_a_slice_of_workload_6(tmp_path, data_dir, cache) -> None:
    rows = (TRACES / "workloads" / "workload-6.csv").read_text().splitlines()[:21]
    trace = tmp_path / "slice.csv"
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    result = simulate(str(trace), "--gpus", "32", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
                      "--pollux-traces", str(TRACES / "traces"), "--policy", "pollux", "--policy", "tiresias",
                      "--out", str(out), "--cache-dir", str(cache), "--no-plots")
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["pollux"]["jobs"] == 20 and metrics["pollux"]["preemptions"] > 0
    assert metrics["pollux"]["avg_jct_s"] < metrics["tiresias"]["avg_jct_s"] < metrics["dp"]["avg_jct_s"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("synthetic", "--gpus", "10", "--gpus-per-node", "4"), "--gpus 10 is not a multiple of --gpus-per-node 4"),
        (("synthetic", "--gpus", "8", "--size-mix", "16:1"), "asks for 16 GPUs but the cluster has 8"),
        (("synthetic", "--gpus", "8", "--policy", "magic"), "unknown --policy 'magic'"),
        (("synthetic", "--gpus", "8", "--fg-slowdown", "0.5"), "--fg-slowdown 0.5 is below 1"),
        (("nosuch.csv", "--gpus", "8"), "trace file 'nosuch.csv' does not exist"),
        (("synthetic", "--gpus", "8", "--plan-objective", "fast"), "--plan-objective 'fast': use cluster or time"),
    ],
)
def test_user_errors_exit_2_with_one_line(args, message, tmp_path) -> None:
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path), "--no-cache"])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_malformed_row_and_unmapped_application(tmp_path, data_dir) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("name,time,application,num_replicas,batch_size,duration\na,0,tiny,2,64,oops\n")
    result = CliRunner().invoke(app, [str(bad), "--gpus", "8", "--no-cache", "--out", str(tmp_path)])
    assert result.exit_code == 2 and f"{bad}:2: field 'duration': 'oops' is not a number" in result.output
    mapping = tmp_path / "map.json"
    mapping.write_text('{"other": {"model": "gpt2"}}')
    good = tmp_path / "good.csv"
    good.write_text("name,time,application,num_replicas,batch_size,duration\na,0,tiny,2,64,10\n")
    result = CliRunner().invoke(app, [str(good), "--gpus", "8", "--mapping", str(mapping), "--no-cache", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "'tiny' has no model mapping" in result.output


def test_an_oversized_job_in_a_real_pollux_workload_is_named(tmp_path) -> None:
    result = CliRunner().invoke(app, [str(TRACES / "workloads" / "workload-6.csv"), "--gpus", "8", "--no-cache",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2 and "workload-6.csv:5: job 'cifar10-3' asks for 16 GPUs but the cluster has 8" in result.output


def test_an_out_that_is_a_file_is_refused_before_the_run(tmp_path) -> None:
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    result = CliRunner().invoke(app, ["nosuch.csv", "--gpus", "8", "--no-cache", "--out", str(taken)])
    assert result.exit_code == 2 and f"--out '{taken}' is a file" in result.output  # before the trace is read


def test_a_second_run_into_the_same_out_is_refused_unless_forced(tmp_path, data_dir, cache) -> None:
    out = tmp_path / "results"
    args = ("synthetic", "--gpus", "8", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
            "--jobs", "10", "--size-mix", "1:0.5,4:0.5", "--out", str(out), "--cache-dir", str(cache))
    assert simulate(*args).exit_code == 0
    first = (out / "metrics.json").read_text()
    again = CliRunner().invoke(app, [*args, "--no-plots", "--seed", "3"])
    assert again.exit_code == 2 and "Traceback" not in again.output
    assert again.output.strip().splitlines() == [(
        f"error: --out '{out}' holds an earlier run (metrics.json, metrics.csv, jobs.csv, run.json, utilisation.png, "
        "jct_cdf.png, throughput.png): give another --out, or --force to replace it")]
    assert (out / "metrics.json").read_text() == first  # untouched
    forced = simulate(*args, "--no-plots", "--seed", "3", "--force")
    assert forced.exit_code == 0, forced.output
    assert json.loads((out / "run.json").read_text())["seed"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["jobs.csv", "metrics.csv", "metrics.json", "run.json"]


def test_an_out_with_other_files_but_no_earlier_run_is_used(tmp_path, data_dir, cache) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    result = simulate("synthetic", "--gpus", "8", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
                      "--jobs", "10", "--size-mix", "1:0.5,4:0.5", "--no-plots", "--out", str(tmp_path),
                      "--cache-dir", str(cache))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "notes.txt").read_text() == "mine\n" and (tmp_path / "metrics.json").is_file()


def test_simulate_deeppool_refuses_an_earlier_scenario_before_planning(tmp_path) -> None:
    from deeppool.cluster_sim.cli import simulate_deeppool

    (tmp_path / "scenario.json").write_text("[]\n")
    scenario = typer.Typer()
    scenario.command()(simulate_deeppool)
    result = CliRunner().invoke(scenario, ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: --out '{tmp_path}' holds an earlier run (scenario.json): give another "
                                     "--out, or --force to replace it")
    assert (tmp_path / "scenario.json").read_text() == "[]\n" and not (tmp_path / "cache").exists()


RUN_AND_REPORT_TORCH = """
import sys
from deeppool.cluster_sim.cli import app
app(sys.argv[1:], standalone_mode=False)
print("torch imported:", "torch" in sys.modules)
"""


def test_torch_is_not_imported_when_every_plan_is_cached(tmp_path, data_dir) -> None:
    args = ["synthetic", "--gpus", "8", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
            "--jobs", "10", "--size-mix", "1:0.5,4:0.5", "--no-plots", "--cache-dir", str(tmp_path / "cache"),
            "--plan-workers", "1"]
    runs = [subprocess.run([sys.executable, "-c", RUN_AND_REPORT_TORCH, *args, "--out", str(tmp_path / f"out{run}")],
                           capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
            for run in range(2)]
    assert "torch imported: True" in runs[0].stdout  # the first run traces and solves
    assert "torch imported: False" in runs[1].stdout  # the second reads every plan from the cache
