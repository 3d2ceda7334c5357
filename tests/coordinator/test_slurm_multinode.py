"""Coordinator jobs over two Slurm nodes: a real multi-node Slurm made of network namespaces on this machine.

Each node is a network namespace with its own address (10.77.0.1, 10.77.0.2)
on a bridge in the root namespace (10.77.0.254), where slurmctld runs; one
slurmd per namespace (``slurmd -N nodeX``), with its spool, pid and log files
named after the node (``%n``). munged's socket is a file, so every namespace
shares it. slurmd enters its namespace with ``nsenter --net``: ``ip netns
exec`` would also mount a fresh /sys, without /sys/fs/cgroup, and slurmd
stops with "Unable to initialize cgroup plugin". Host names do not tell the
namespaces apart, so the jobs' gloo uses the interface each namespace names
``dpnet0`` (``GLOO_SOCKET_IFNAME``). Where the namespaces or Slurm cannot
start, the tests fail, naming what did not come up (they are skipped only
where the packages cannot be installed, or this is not root); the daemons (munged too, if the
fixture started it), whatever still runs in the namespaces, the namespaces
and the bridge are removed afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deeppool.coordinator.client import Client
from deeppool.coordinator.driver import DriverSteps
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LaunchPhase
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.slurm import SlurmLauncher
from deeppool.coordinator.store import Store
from deeppool.errors import DeeppoolError
from deeppool.plans import Plan
from tests.coordinator.accounts import job_folder
from tests.coordinator.test_durability import start
from tests.coordinator.test_runtime import settle
from tests.coordinator.test_slurm import _ensure_packages, _start_munge, _stop_munge, not_up, slurm_folder
from tests.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
"""In the heavy tier (25 s): the coordinator's Slurm launch runs in test_slurm.py and test_slurm_script.py, and
a plan over two hosts in test_executor_multinode.py."""

SUBNET = "10.77.0"
CONTROLLER = f"{SUBNET}.254"
INTERFACE = "dpnet0"
MODEL = Path(__file__).resolve().parent / "models" / "burst_cnn.py"
BACKGROUND = Path(__file__).resolve().parents[2] / "examples" / "background_mlp.py"

CONF = """ClusterName=deeppoolmulti
SlurmctldHost={host}({controller})
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{nodes}
PartitionName=multi Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The running Slurm: each node's name and address, and the nodes' network namespaces."""

    nodes: tuple[tuple[str, str], ...]
    namespaces: tuple[str, ...]


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(f"the nodes' network did not come up: {' '.join(command)}: {done.stderr.strip()}")


def _network(tag: str, count: int) -> list[str]:
    """A bridge with the controller's address, and ``count`` namespaces on it; returns the namespaces."""
    bridge = f"{tag}br"
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", f"{CONTROLLER}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    names = []
    for i in range(count):
        name, outer, inner = f"{tag}n{i}", f"{tag}v{i}", f"{tag}p{i}"
        _ip("netns", "add", name)
        names.append(name)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        _ip("link", "set", outer, "master", bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "name", INTERFACE, netns=name)
        _ip("addr", "add", f"{SUBNET}.{i + 1}/24", "dev", INTERFACE, netns=name)
        _ip("link", "set", INTERFACE, "up", netns=name)
        _ip("link", "set", "lo", "up", netns=name)
    return names


def _teardown(tag: str, daemons: list[subprocess.Popen]) -> None:
    """Stop the daemons and whatever still runs in the namespaces, then delete the namespaces and the bridge."""
    for daemon in daemons:
        daemon.terminate()
    deadline = time.monotonic() + 10  # one grace period for all of them: they stop side by side
    for daemon in daemons:
        try:
            daemon.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in (n for n in listed if n.startswith(f"{tag}n")):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    subprocess.run(["ip", "link", "delete", f"{tag}br"], capture_output=True)


def _wait_idle(env: dict[str, str], daemons: list[subprocess.Popen], count: int, root: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and all(d.poll() is None for d in daemons):
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                                text=True).stdout.split()
        if len(states) == count and all(s in ("idle", "mix", "alloc") for s in states):
            return
        time.sleep(0.5)
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True).stdout
    pytest.fail(not_up(f"the namespaced Slurm nodes ({' '.join(states.split()) or 'sinfo: no answer'})",
                       {f"daemon {i}": d for i, d in enumerate(daemons)}, root))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and Slurm's daemons need root")
    if shutil.which("ip") is None:
        pytest.fail("iproute2's `ip` is not installed: the nodes' network namespaces cannot be made")
    _ensure_packages()
    started_munge = _start_munge()
    tag, daemons = f"dps{os.getpid() % 100000}", []
    old = os.environ.get("SLURM_CONF")
    root = slurm_folder()  # the nodes' spools (spool-%n) are made by slurmd, 0755
    try:
        namespaces = _network(tag, 2)
        nodes = tuple((f"node{i}", f"{SUBNET}.{i + 1}") for i in range(len(namespaces)))
        (root / "state").mkdir()
        (root / "state").chmod(0o755)  # explicitly: a server run in this process earlier left its umask 077
        conf = root / "slurm.conf"
        lines = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={os.cpu_count() or 1} State=UNKNOWN" for n, a in nodes)
        conf.write_text(CONF.format(host=socket.gethostname().split(".")[0], controller=CONTROLLER, root=root,
                                    ctld_port=free_port(), d_port=free_port(), nodes=lines,
                                    names=",".join(n for n, _ in nodes)))
        conf.chmod(0o644)  # every job account's Slurm commands read it
        env = {**os.environ, "SLURM_CONF": str(conf)}
        quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], **quiet))
        daemons += [subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "slurmd", "-D", "-N", name, "-f",
                                      str(conf)], **quiet) for ns, (name, _) in zip(namespaces, nodes)]
        _wait_idle(env, daemons, len(nodes), root)
        os.environ["SLURM_CONF"] = str(conf)
        yield Cluster(nodes=nodes, namespaces=tuple(namespaces))
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        _teardown(tag, daemons)
        shutil.rmtree(root, ignore_errors=True)
        if started_munge:
            _stop_munge()


def test_the_coordinator_runs_a_job_over_two_slurm_nodes(cluster: Cluster, tmp_path: Path) -> None:
    """``deeppool serve --launcher slurm --nodes 2``: the job's state, log and result come back through the API.

    A background job waits too, so the foreground job takes it as its guest: it trains in the idle windows of
    both nodes' ranks.
    """
    db, port, folder = tmp_path / "db.sqlite", free_port(), job_folder()  # root submits as the job account
    store = Store(db)
    secret = store.create_token("alice")
    # both queued before the server starts, so its first tick (before it serves) sees them together; at batch 32
    # the plan on two A100s is burst (at 16 the convolutions' 2-GPU all-reduce latency outweighs what they gain)
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=32, steps=10))
    guest, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8))
    store.close()
    server = start(db, port, gpus=2, allow=(MODEL.parent, BACKGROUND.parent), env={"GLOO_SOCKET_IFNAME": INTERFACE},
                   logs=folder, options=("--launcher", "slurm", "--nodes", "2", "--check"))
    try:
        client = Client(f"http://127.0.0.1:{port}", secret)
        with pytest.raises(DeeppoolError, match="do not split evenly over the 2 nodes"):
            client.submit(JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=1, batch=16, steps=3))
        deadline = time.monotonic() + 300
        while not (job := client.job(job.id)).state.terminal and time.monotonic() < deadline:
            time.sleep(0.5)
        log = client.logs(job.id).text
        guest = client.job(guest.id)
    finally:
        server.terminate()
        server.wait(30)
    assert job.state is JobStatus.SUCCEEDED and job.exit_code == 0, log[-3000:]
    assert guest.state is JobStatus.SUCCEEDED and guest.host_id == job.id, guest
    assert "trained" in guest.reason and " 0 steps" not in guest.reason
    assert "#SBATCH --nodes=2" in (folder / f"job-{job.id}.1.sbatch").read_text()
    assert f"nodes: node0 ({SUBNET}.1), node1 ({SUBNET}.2); rendezvous at {SUBNET}.1:" in log
    for task, (_, address) in enumerate(cluster.nodes):  # srun labels each line with its task: one per node
        assert re.search(rf"^{task}: machine \S+ \({re.escape(address)}\): 1 of the 2 ranks", log, re.M), log[-3000:]
    plan = Plan.load(folder / f"job-{job.id}" / "plan.json")
    assert {layer.gpus for layer in plan.layers} == {1, 2}  # a burst plan: some layers on both nodes, some on one
    run = folder / f"job-{job.id}" / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["gpus"] == 2 and summary["check"]["passed"]  # every step as single-process training
    assert sorted(p.name for p in run.glob("trace-rank*.json")) == ["trace-rank0.json", "trace-rank1.json"]


def _deeppool_processes(namespace: str) -> list[str]:
    """The command lines of deeppool's processes in ``namespace`` (its slurmd's job steps)."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if " -m deeppool." in cmdline:
            found.append(cmdline)
    return found


def test_a_cancelled_two_node_job_stops_on_both_nodes(cluster: Cluster, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", INTERFACE)  # sbatch and srun pass the environment on
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    folder = tmp_path / "jobs"
    rt = Runtime(store, SlurmLauncher(folder), DriverSteps(folder=folder, nodes=2), grace_s=2.0, nodes=2)
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=16,
                                              steps=100000))
    rt.start(job, "granted")
    log = rt.launcher.files(job.id, 1).log
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(_deeppool_processes(ns) for ns in cluster.namespaces):
        time.sleep(0.5)
    assert all(_deeppool_processes(ns) for ns in cluster.namespaces), log.read_text()[-3000:]
    settle(rt, job.id, lambda j: j.state is JobStatus.RUNNING, timeout_s=60)
    rt.store.transition(job.id, JobStatus.CANCELLED, "cancelled by alice")
    rt.reconcile()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_deeppool_processes(ns) for ns in cluster.namespaces):
        time.sleep(0.5)
    assert not any(_deeppool_processes(ns) for ns in cluster.namespaces)
    assert rt.launcher.observe(job.id, 1).phase not in (LaunchPhase.RUNNING, LaunchPhase.QUEUED)
    assert rt.store.job(job.id).state is JobStatus.CANCELLED
