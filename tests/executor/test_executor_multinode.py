"""Several machines: `deeppool run --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID` on each, as with torchrun.

Two launchers on this machine stand for two machines: each starts its share of
the ranks, they meet at the rendezvous, and the burst plan trains exactly as
single-process training does (--check). Only the rank-0 machine writes the
summary. Then two hosts with their own addresses: network namespaces joined by
a veth pair, where host names resolve to nothing useful.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net import free_port

from tests.executor.plans import cycle, make_plan

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow



def node(plan: Path, out: Path, *, nnodes: int, nproc: int, endpoint: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nnodes", str(nnodes), "--nproc", str(nproc),
         "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode-test", "--steps", "3", "--check", "--lr", "0.1",
         "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.heavy
def test_two_machines_train_a_burst_plan_exactly(tmp_path: Path) -> None:
    """In the heavy tier (13 s): two nodes train exactly in the default run, in network namespaces
    (``test_two_hosts_in_network_namespaces_train_exactly``) and under Slurm (``test_slurm_multinode``)."""
    plan = tmp_path / "plan.json"
    make_plan("residual", global_batch=7, gpus=4, assign=cycle(1, 4, 2, 3)).save(plan)
    endpoint = f"127.0.0.1:{free_port()}"
    machines = [node(plan, tmp_path / f"machine{i}", nnodes=2, nproc=2, endpoint=endpoint) for i in range(2)]
    outputs = [m.communicate(timeout=240)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("machine*/summary.json")]
    assert len(summaries) == 1  # rank 0's machine reports the run
    assert summaries[0]["gpus"] == 4 and summaries[0]["check"]["passed"]
    traces = sorted(p.name for p in tmp_path.glob("machine*/trace-rank*.json"))
    assert traces == [f"trace-rank{r}.json" for r in range(4)]  # every global rank ran somewhere


@pytest.mark.parametrize(("args", "message"), [
    (["--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohost", "--rdzv-id", "x"], "is not HOST:PORT"),
    (["--nnodes", "2", "--nproc", "3", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"], "--nproc x --nnodes = 4"),
    (["--nnodes", "0"], "--nnodes 0"),
])
def test_multi_machine_mistakes_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    plan = tmp_path / "plan.json"
    make_plan("residual", global_batch=7, gpus=4, assign=cycle(1, 4, 2, 3)).save(plan)
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", "run", str(plan), *args, "--out", str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error:") and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair: two hosts with their own addresses (root and iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"dp{os.getpid() % 100000}"
    names, links = (f"{tag}a", f"{tag}b"), (f"{tag}x", f"{tag}y")
    commands = [
        *(["ip", "netns", "add", name] for name in names),
        ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]],
        *(["ip", "link", "set", link, "netns", name] for link, name in zip(links, names)),
        *(["ip", "netns", "exec", name, "ip", "addr", "add", f"10.91.0.{i + 1}/24", "dev", link]
          for i, (link, name) in enumerate(zip(links, names))),
        *(["ip", "netns", "exec", name, "ip", "link", "set", link, "up"] for link, name in zip(links, names)),
        *(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"] for name in names),
    ]
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {' '.join(command)}: {done.stderr.strip()}")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_two_hosts_in_network_namespaces_train_exactly(tmp_path: Path, two_hosts: tuple[str, str]) -> None:
    plan = tmp_path / "plan.json"
    make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1)).save(plan)
    endpoint = "10.91.0.1:29517"
    hosts = []
    for i, (name, link) in enumerate(zip(two_hosts, ("x", "y"))):
        interface = f"{name[:-1]}{link}"
        hosts.append(subprocess.Popen(
            ["ip", "netns", "exec", name, "env", f"GLOO_SOCKET_IFNAME={interface}", sys.executable, "-m",
             "deeppool.cli", "run", str(plan), "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint,
             "--rdzv-id", "netns-test", "--steps", "3", "--check", "--lr", "0.1", "--out", str(tmp_path / f"host{i}")],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [h.communicate(timeout=240)[0] for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], [o[-2000:] for o in outputs]
    summary = json.loads((tmp_path / "host0" / "summary.json").read_text())  # the endpoint's host runs rank 0
    assert summary["gpus"] == 2 and summary["check"]["passed"]
