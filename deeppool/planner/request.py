"""What to plan for and where layer times come from: checked at construction, before any tracing.

Neither type imports torch, so the command line refuses a bad option in well
under a second; :mod:`deeppool.planner.api` does the work.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool import checks
from deeppool.errors import DeeppoolError
from deeppool.plans import NetworkModel, Objective, Optimizer, Pin, Precision, Strategy
from deeppool.planner.hardware import LOCAL_NETWORK, NETWORKS, KnownDevice, known_device
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.planner.profiling.profile import Profile
from deeppool.planner.solve.candidates import Limits
from deeppool.planner.solve.cost import DEFAULT_BUCKET_BYTES
from deeppool.planner.solve.throughput import DEFAULT_CLUSTER_GAP

if TYPE_CHECKING:  # the solver (pulp, highspy) loads when a --solver is named or a plan is solved
    from deeppool.planner.solve.ilp import SolverName

LOCAL = "local"
DEFAULT_MAX_CANDIDATES = 32
"""Keeps every useful count up to a global batch of about 300; thins larger problems."""


def check_objective(objective: Objective, price: float) -> None:
    """Refuse a negative price, or the trade-off objective without a price."""
    if price < 0:
        raise DeeppoolError(f"--price {price} must be >= 0")
    if objective is Objective.TIME_AND_GPU_TIME and price == 0:
        raise DeeppoolError("--objective time+gpu-time needs a --price > 0 (ms of iteration per GPU-second)")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan for: GPUs, global batch, strategy and limits."""

    gpus: int
    global_batch: int
    strategy: Strategy = Strategy.ILP
    optimizer: Optimizer = Optimizer.SGD
    amplification: float | None = None
    enforce_memory: bool = True
    time_limit_s: float = 60.0
    solver: SolverName | None = None
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES
    bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    precision: Precision | None = None
    objective: Objective = Objective.TIME
    price: float = 0.0
    cluster_gap: float = DEFAULT_CLUSTER_GAP
    """``--cluster-gap``: the cluster objective's proven gap (0: exactly the best)."""
    pins: tuple[Pin, ...] = ()
    """Layers whose GPU counts are fixed (``--pin GLOB=N``); the ILP solves the rest."""
    interference: InterferenceModel = InterferenceModel()
    """How background work fills idle windows (``--interference``): the cluster objective and shares."""
    interference_source: str = "defaults"

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise DeeppoolError(f"--gpus {self.gpus}: plan for at least 1 GPU")
        if self.global_batch < 1:
            raise DeeppoolError(f"--batch {self.global_batch}: the global batch must be at least 1")
        if self.time_limit_s <= 0:
            raise DeeppoolError(f"--time-limit {self.time_limit_s:g} must be positive (seconds)")
        if self.max_candidates is not None and self.max_candidates < 2:
            raise DeeppoolError("--max-candidates must be at least 2 (0 keeps every useful count)")
        if self.bucket_mb < 0:
            raise DeeppoolError(f"--bucket-mb {self.bucket_mb} must be >= 0")
        Limits(amplification=self.amplification)
        check_objective(self.objective, self.price)
        if not 0 <= self.cluster_gap < 1:
            raise DeeppoolError(f"--cluster-gap {self.cluster_gap:g} must be at least 0 and below 1 "
                                "(a share of the cluster's throughput, e.g. 0.002)")
        if self.pins and self.strategy is not Strategy.ILP:
            raise DeeppoolError(f"--pin fixes layers of the ILP's plan; --strategy {self.strategy.value} ignores it: "
                                "drop --pin or use --strategy ilp")


def check_samples(gpus: int, global_batch: int) -> None:
    """A job's GPUs each need at least one sample of the global batch (strong scaling splits it)."""
    if gpus > global_batch:
        raise DeeppoolError(
            f"--gpus {gpus} is more than --batch {global_batch}: every GPU needs at least one sample; "
            f"plan for at most {global_batch} GPUs or a global batch of at least {gpus}"
        )


@dataclass(frozen=True, kw_only=True)
class CostSource:
    """Where layer times come from: a device model, a profile file, or measuring here.

    ``device_model`` is v100/a100/h100 (estimated) or ``local`` (measured on
    ``local_device`` at every per-GPU batch the plan and its baselines use:
    :mod:`deeppool.planner.measure_loop`; ``max_measured_batch``, when set,
    caps them, the larger ones fitted). ``cache_dir`` None measures
    everything afresh (``--no-cache``). ``network`` names a
    preset (a device model or ``local``), ``network_file`` a measured network
    (``deeppool profile-network``) instead, ``measured_network`` one measured for this plan; the three
    overrides replace figures.
    """

    device_model: str = LOCAL
    profile_path: Path | None = None
    local_device: str = "cpu"
    max_measured_batch: int | None = None
    cache_dir: Path | None = None
    network: str | None = None
    network_file: Path | None = None
    gpus_per_node: int | None = None
    intra_gbps: float | None = None
    inter_gbps: float | None = None
    show_progress: bool = True
    measured_network: Callable[[], NetworkModel] | None = None
    """This host's network for the plan's ranks, measured when the planner first asks for it (``deeppool plan``
    on the local CPU with neither ``--network`` nor ``--network-file``: a model that fails to load or trace
    costs no probe; :func:`deeppool.planner.profiling.netprobe.local_network`)."""

    def __post_init__(self) -> None:
        if self.device_model != LOCAL:
            _named_device(self.device_model, "--device-model")
        if self.network not in (None, LOCAL):
            _named_device(self.network, "--network")
        if self.network is not None and self.network_file is not None:
            raise DeeppoolError("give either --network or --network-file, not both")
        checks.existing_file(self.profile_path, "--profile")
        checks.existing_file(self.network_file, "--network-file")
        if self.network_file is not None:
            NetworkModel.load(self.network_file)  # a bad file is refused before any tracing
        if self.profile_path is not None:
            Profile.load(self.profile_path)
        if self.measures_locally:
            checks.device(self.local_device, "--local-device")
        if self.max_measured_batch is not None and self.max_measured_batch < 1:
            raise DeeppoolError(f"--max-measured-batch {self.max_measured_batch} must be at least 1")
        checks.at_least(self.gpus_per_node, 1, "--gpus-per-node")
        checks.positive(self.intra_gbps, "--intra-gbps")
        checks.positive(self.inter_gbps, "--inter-gbps")

    @property
    def measures_locally(self) -> bool:
        return self.profile_path is None and self.device_model == LOCAL

    def threads(self, request: PlanRequest) -> int | None:
        """Intra-op threads while measuring on the CPU: one rank's share of the cores (None on a GPU)."""
        return rank_threads(request.gpus) if self.local_device == "cpu" else None

    def network_model(self, profile: Profile) -> NetworkModel:
        if self.measured_network is not None:
            base = self.measured_network()
        elif self.network_file is not None:
            base = NetworkModel.load(self.network_file)
        else:
            preset = self.network or self._preset_for(profile)
            base = LOCAL_NETWORK if preset == LOCAL else NETWORKS[known_device(preset)]
        return base.with_overrides(
            gpus_per_node=self.gpus_per_node, intra_gbps=self.intra_gbps, inter_gbps=self.inter_gbps
        )

    def _preset_for(self, profile: Profile) -> str:
        if self.profile_path is None:
            return self.device_model
        named = [known.value for known in KnownDevice if known.value in profile.device.lower()]
        return named[0] if named else LOCAL


def check_precision(request: PlanRequest, source: CostSource) -> None:
    """``--precision`` picks a device model's peak; a measured profile keeps the precision it was measured in."""
    if request.precision is not None and source.device_model == LOCAL:
        raise DeeppoolError(
            f"--precision {request.precision.value} applies to a --device-model (v100, a100, h100, h200); "
            "a measured profile keeps the precision it was measured in"
        )


def rank_threads(gpus: int) -> int:
    """The intra-op threads a rank of a ``gpus``-rank run on this host gets: ``$OMP_NUM_THREADS`` where it is a
    positive number (``deeppool run`` passes it to its ranks), else its share of the cores."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // gpus)


def probed_source(source: CostSource, gpus: int, say: Callable[[str], None]) -> CostSource:
    """``source`` with this host's network for ``gpus`` gloo ranks, measured when the planner first asks for it
    (:func:`~deeppool.planner.profiling.netprobe.local_network`, kept in ``source.cache_dir``), where it
    measures on this CPU for several ranks and names no network (``--network``, ``--network-file``). The local
    preset's guess (5 GB/s, 50 µs, no synchronisation latency or skew) underprices gloo on shared cores
    (``docs/notes/0008-plan-probes-its-network.md``). Above ``CPU_RANKS_PER_CORE`` ranks per core the probe
    would measure contention: the preset stays. ``say`` gets one line on where the network came from."""
    if not (source.measures_locally and source.local_device == "cpu" and gpus > 1
            and source.network is None and source.network_file is None):
        return source
    cores = os.cpu_count() or 1
    per_core = checks.CPU_RANKS_PER_CORE
    if gpus > per_core * cores:
        say(f"network: the local preset, not measured ({gpus} ranks are more than {per_core} per core "
            f"of this host's {cores}); --network-file names a measured one")
        return source

    def measured() -> NetworkModel:  # imports torch: only once the planner asks
        from deeppool.planner.profiling.netprobe import local_network

        found = local_network(gpus, source.cache_dir, say=say)
        how = "measured now" if found.measured_now else "measured earlier"
        kept = f", kept in {found.path}" if found.path is not None else ""
        say(f"network: this host's, {how} with {gpus} gloo processes{kept} (`deeppool profile-network` measures "
            "it again; --network local assumes the preset)")
        return found.model

    return replace(source, measured_network=functools.cache(measured))


def _named_device(name: str, flag: str) -> None:
    try:
        known_device(name)
    except DeeppoolError as err:
        raise DeeppoolError(f"{flag}: {err}") from None
