"""Reading traces, generating workloads, mapping jobs to models, and the errors users see."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.models import ModelMapping, default_mapping, load_mapping
from deeppool.cluster_sim.pollux import Application, PolluxDurations, packed_placement
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
    assert [packed_placement(g) for g in (1, 4, 6, 12, 16)] == ["1", "4", "24", "444", "4444"]


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


def test_philly_dates_are_utc_whatever_the_local_time_zone(tmp_path, monkeypatch) -> None:
    path = write(tmp_path, PHILLY + "2017-10-09 07:00:00,60.0,1,60.0,a\n2017-11-05 09:00:00,60.0,1,60.0,b\n")
    arrivals = []
    for zone in ("UTC", "America/Los_Angeles"):  # the second pair of dates spans a DST change there
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        arrivals.append([job.arrival_s for job in read_workload(path).jobs])
    monkeypatch.delenv("TZ")
    time.tzset()
    assert arrivals[0] == arrivals[1] == [0.0, 27 * 86400 + 2 * 3600]


def test_duplicate_names_and_absurd_durations_are_refused(tmp_path) -> None:
    header = "name,time,application,num_replicas,batch_size,duration\n"
    with pytest.raises(DeeppoolError, match=r"trace.csv:3: job name 'a' is already used at .*trace.csv:2"):
        read_workload(write(tmp_path, header + "a,0,tiny,1,64,10\na,5,tiny,1,64,10\n"))
    with pytest.raises(DeeppoolError, match=r":2: field 'duration': 1e300 s is over"):
        read_workload(write(tmp_path, header + "a,0,tiny,1,64,1e300\n"))


def test_an_unknown_application_is_not_drawn_at_random() -> None:
    mapping = default_mapping(spread=False)
    with pytest.raises(DeeppoolError, match=r"here: 'resnet9000' has no model mapping in the default mapping \(applications: bert"):
        mapping.resolve("resnet9000", random.Random(0), where="here")
    assert default_mapping(spread=True).resolve("6214e9", random.Random(0), where="here").name in ("vgg16", "resnet50", "inception", "gpt2")


def test_pollux_run_times_accumulate_gradients_and_are_never_near_zero() -> None:
    bert = Application.read(TRACES / "traces" / "bert")
    assert bert.max_local_bsz == 12 and bert.init_batch == 12
    # bert on 6 GPUs at batch 384: 64 per GPU over 6 micro-batches (5 accumulation steps), each of
    # at most 384 / (6 GPUs x 6) = 10 samples, as the Pollux simulator caps them
    step, sync = bert.placements["24"].at(10)
    assert bert.step_time_s(6, 384) == pytest.approx(step + 5 * (step - sync))
    durations = PolluxDurations(root=TRACES / "traces")
    shortest = min(
        job.duration_s for path in sorted(TRACES.glob("workloads*/workload-*.csv"))
        for job in read_workload(path, pollux_traces=TRACES / "traces").jobs
    )
    assert shortest > 30.0  # ncf on one GPU, the shortest application, takes about a minute
    above = durations.duration_s("imagenet", 48, 6400, where="w")
    assert 0 < above < durations.duration_s("imagenet", 16, 6400, where="w")  # scalability.csv beyond 16 GPUs
    with pytest.raises(DeeppoolError, match="beyond imagenet's measured maximum of 64"):
        durations.duration_s("imagenet", 128, 6400, where="w")


def test_the_batch_grows_with_the_gpu_count(tmp_path, data_dir) -> None:
    cluster = ClusterSpec(gpus=128, gpus_per_node=8)
    philly = read_workload(write(tmp_path, PHILLY + "2017-10-09 07:00:00,60,128,7680,a\n2017-10-09 07:00:01,60,2,120,a\n"))
    gpt2 = ModelMapping(fallback=default_mapping().by_key["gpt2"])
    assignment = assign(philly, mapping=gpt2, rule=BackgroundRule(), cluster=cluster, seed=0, drop_oversized=False)
    assert [m.global_batch for m in assignment.models] == [8 * 128, 8 * 2]  # gpt2: 64 at 8 GPUs, 8 per GPU
    pollux = read_workload(write(tmp_path, "name,time,application,num_replicas,batch_size,duration\nx,0,tiny,4,48,60\n"))
    tiny = load_mapping(data_dir / "mapping.json")
    (model,) = assign(pollux, mapping=tiny, rule=BackgroundRule(), cluster=cluster, seed=0, drop_oversized=False).models
    assert model.global_batch == 64  # the entry's fixed batch: the column is not in tiny's samples
    own = tmp_path / "own.json"
    own.write_text('{"*": {"model": "%s", "global_batch": 64, "trace_batch": true}}' % (data_dir / "tiny_mlp.py"))
    (model,) = assign(pollux, mapping=load_mapping(own), rule=BackgroundRule(), cluster=cluster, seed=0,
                      drop_oversized=False).models
    assert model.global_batch == 48  # the trace's batch_size column, in the model's own samples
    starved = read_workload(write(tmp_path, "name,time,application,num_replicas,batch_size,duration\nx,0,tiny,128,32,60\n"))
    with pytest.raises(DeeppoolError, match="trains at batch 64 on 128 GPUs: some GPUs would hold no sample"):
        assign(starved, mapping=tiny, rule=BackgroundRule(), cluster=cluster, seed=0, drop_oversized=False)
