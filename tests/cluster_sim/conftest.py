"""Shared fixtures: a tiny model, planned once per session by the real planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.models import load_mapping
from deeppool.cluster_sim.plans import PlanBook, PlanSettings
from deeppool.cluster_sim.shipped import POLLUX
from deeppool.scheduling.choice import ModelChoice

DATA = Path(__file__).parent / "data"
TRACES = POLLUX
"""The Pollux artifact as shipped in the package (``deeppool/cluster_sim/data/``)."""


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def cluster() -> ClusterSpec:
    return ClusterSpec(gpus=16, gpus_per_node=4)


@pytest.fixture(scope="session")
def tiny() -> ModelChoice:
    return load_mapping(DATA / "mapping.json").fallback


@pytest.fixture(scope="session")
def book(cluster: ClusterSpec, tmp_path_factory: pytest.TempPathFactory) -> PlanBook:
    """Real planner Plans of the tiny model (traced once; cached under a session temp dir)."""
    return PlanBook(cluster=cluster, settings=PlanSettings(time_limit_s=10), cache_dir=tmp_path_factory.mktemp("plans"))
