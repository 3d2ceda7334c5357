"""Reading traces, generating workloads, mapping jobs to models, and the errors users see."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.models import ModelMapping, default_mapping, load_mapping
from deeppool.cluster_sim.pollux import packed_placement
from deeppool.cluster_sim.runner import assign
from deeppool.cluster_sim.workload import (
    BackgroundKind,
    BackgroundRule,
    SyntheticSpec,
    TraceFormat,
    read_workload,
    synthetic,
)
from deeppool.errors import DeeppoolError

from .conftest import TRACES

PHILLY = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_philly_rows_become_seconds_from_the_first_submission(tmp_path) -> None:
    path = write(tmp_path, PHILLY + "2017-10-09 07:01:55,66.0,1,66.0,aa\n2017-10-09 06:01:55,10,8,80,bb\n\n")
    workload = read_workload(path)
    assert workload.format is TraceFormat.PHILLY
    assert [(j.arrival_s, j.gpus, j.duration_s, j.key) for j in workload.jobs] == [(0.0, 8, 10.0, "bb"), (3600.0, 1, 66.0, "aa")]


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("2017-10-09 07:01:55,abc,1,66.0,aa", "duration"),
        ("2017-13-45 07:01:55,66,1,66.0,aa", "timestamp"),
        ("2017-10-09 07:01:55,66,0,66.0,aa", "num_gpus"),
        ("2017-10-09 07:01:55,66,1.5,66.0,aa", "num_gpus"),
        ("2017-10-09 07:01:55,66,1,66.0,", "cluster"),
    ],
)
def test_a_malformed_row_names_file_line_and_field(tmp_path, row, field) -> None:
    path = write(tmp_path, PHILLY + "2017-10-09 07:01:55,66.0,1,66.0,aa\n" + row + "\n")
    with pytest.raises(DeeppoolError, match=rf"{path}:3: field '{field}'"):
        read_workload(path)


def test_wrong_field_count_and_unknown_header(tmp_path) -> None:
    with pytest.raises(DeeppoolError, match=r":2: has 4 fields"):
        read_workload(write(tmp_path, PHILLY + "2017-10-09 07:01:55,66.0,1,66.0\n"))
    with pytest.raises(DeeppoolError, match="neither the Philly format"):
        read_workload(write(tmp_path, "a,b\n1,2\n", "other.csv"))
    with pytest.raises(DeeppoolError, match="does not exist"):
        read_workload(tmp_path / "missing.csv")


def test_pollux_workload_with_durations_derived_from_the_measurements() -> None:
    workload = read_workload(TRACES / "workloads" / "workload-6.csv")
    assert workload.format is TraceFormat.POLLUX and len(workload.jobs) == 160
    assert all(job.duration_s > 0 for job in workload.jobs)
    arrivals = [job.arrival_s for job in workload.jobs]
    assert arrivals == sorted(arrivals)
    first = workload.jobs[0]
    assert (first.name, first.key, first.gpus, first.batch_size) == ("cifar10-0", "cifar10", 6, 2048)


def test_pollux_without_measurements_asks_for_them(tmp_path) -> None:
    path = write(tmp_path, "name,time,application,num_replicas,batch_size\nx,0,bert,2,64\n")
    with pytest.raises(DeeppoolError, match="--pollux-traces"):
        read_workload(path)
    with pytest.raises(DeeppoolError, match=r":2: field 'application': no measured data for 'nosuch'"):
        read_workload(write(tmp_path, "name,time,application,num_replicas,batch_size\nx,0,nosuch,2,64\n"),
                      pollux_traces=TRACES / "traces")


def test_packed_placements_match_the_measured_strings() -> None:
    assert [packed_placement(g) for g in (1, 4, 6, 12, 16, 48)] == ["1", "4", "24", "444", "4444", "4444"]


def test_synthetic_workloads_are_reproducible() -> None:
    spec = SyntheticSpec(jobs=50, arrivals_per_hour=10, seed=3)
    assert synthetic(spec) == synthetic(spec)
    assert synthetic(spec) != synthetic(SyntheticSpec(jobs=50, arrivals_per_hour=10, seed=4))
    assert {job.gpus for job in synthetic(spec).jobs} <= {1, 2, 4, 8, 16}


def test_background_rules() -> None:
    job = synthetic(SyntheticSpec(jobs=1, arrivals_per_hour=1, size_mix=((1, 1.0),))).jobs[0]
    assert BackgroundRule().is_background(job)
    assert not BackgroundRule.parse("none").is_background(job)
    assert BackgroundRule.parse("gpus<=4").max_gpus == 4
    assert BackgroundRule.parse(f"app:{job.key},x").is_background(job)
    assert BackgroundRule.parse("column").kind is BackgroundKind.COLUMN
    with pytest.raises(DeeppoolError, match="no 'background' column"):
        BackgroundRule.parse("column").is_background(job)
    with pytest.raises(DeeppoolError, match="--background 'gpus<3'"):
        BackgroundRule.parse("gpus<3")


def test_background_column(tmp_path) -> None:
    path = write(tmp_path, PHILLY.strip() + ",background\n2017-10-09 07:01:55,66.0,4,264,aa,true\n2017-10-09 07:01:56,66.0,1,66,aa,no\n")
    flags = [BackgroundRule.parse("column").is_background(job) for job in read_workload(path).jobs]
    assert flags == [True, False]


def test_default_mapping_covers_the_pollux_applications_and_spreads_philly_jobs() -> None:
    mapping = default_mapping()
    rng = random.Random(0)
    assert mapping.resolve("imagenet", rng, where="x").name == "resnet50"
    drawn = {mapping.resolve("6214e9", rng, where="x").name for _ in range(50)}
    assert drawn == {"vgg16", "resnet50", "inception", "gpt2"}


def test_mapping_file_errors_name_the_key(tmp_path, data_dir) -> None:
    mapping = load_mapping(write(tmp_path, '{"bert": {"model": "gpt2"}}', "map.json"))
    with pytest.raises(DeeppoolError, match=r"where: 'yolov3' has no model mapping in mapping file"):
        mapping.resolve("yolov3", random.Random(0), where="where")
    with pytest.raises(DeeppoolError, match="needs a \"model\""):
        load_mapping(write(tmp_path, '{"bert": {}}', "bad.json"))
    with pytest.raises(DeeppoolError, match="not valid JSON"):
        load_mapping(write(tmp_path, "{", "broken.json"))
    with pytest.raises(DeeppoolError, match="needs a global_batch"):
        load_mapping(write(tmp_path, f'{{"x": {{"model": "{data_dir / "tiny_mlp.py"}"}}}}', "nobatch.json"))


def test_impossible_clusters_and_oversized_jobs() -> None:
    with pytest.raises(DeeppoolError, match="--gpus 10 is not a multiple of --gpus-per-node 4"):
        ClusterSpec(gpus=10, gpus_per_node=4)
    workload = synthetic(SyntheticSpec(jobs=5, arrivals_per_hour=1, size_mix=((1, 1.0), (16, 1.0)), seed=1))
    small = ClusterSpec(gpus=8, gpus_per_node=4)
    mapping = ModelMapping(spread=default_mapping().spread)
    with pytest.raises(DeeppoolError, match="asks for 16 GPUs but the cluster has 8"):
        assign(workload, mapping=mapping, rule=BackgroundRule(), cluster=small, seed=0, drop_oversized=False)
    kept = assign(workload, mapping=mapping, rule=BackgroundRule(), cluster=small, seed=0, drop_oversized=True)
    assert kept.dropped == sum(job.gpus > 8 for job in workload.jobs) > 0
