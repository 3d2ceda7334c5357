"""The device being measured: its name, its memory and how much of it a profiling pass may take, and its memory
bandwidth (what an optimizer's step streams at)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from deeppool.device.cuda import gpu_for
from deeppool.planner.profiling.timing import timed


def device_name(device: torch.device) -> str:
    gpu = gpu_for(device)
    if gpu is not None:
        return gpu.name(device).replace(" ", "-").lower()
    return f"cpu-{os.cpu_count()}c-{torch.get_num_threads()}t"


def device_memory(device: torch.device) -> int:
    gpu = gpu_for(device)
    if gpu is not None:
        return gpu.total_memory(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(device: torch.device) -> int:
    """Bytes a profiling pass may take: most of the device's free memory, and at most half a CPU host's memory
    (others share it)."""
    gpu = gpu_for(device)
    if gpu is not None:
        return int(0.8 * gpu.free_memory(device))
    return int(min(0.5 * device_memory(device), 0.8 * _available_memory()))


def _available_memory() -> int:
    """The host's available memory (MemAvailable), or its free pages where /proc/meminfo is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def memory_bandwidth(device: torch.device, megabytes: int = 64, repeats: int = 5) -> float:
    """Effective bytes/s of an in-place add over large tensors (what an optimizer step does)."""
    count = megabytes * 2**20 // 4
    left, right = torch.ones(count, device=device), torch.ones(count, device=device)
    times = []
    for _ in range(repeats + 1):
        elapsed, _ = timed(device, lambda: left.add_(right, alpha=1e-6))
        times.append(elapsed)
    return 3 * count * 4 / (statistics.median(times[1:]) / 1e3)
