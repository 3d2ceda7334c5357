"""The replay's picture: slots over time, each job a coloured band, one panel per run (live, then simulated).

The coordinator and the simulator hand out slots as a pool, by count, so the picture places each job's
interval on the lowest slots free for its whole length (first fit, in start order); a job resized while it
ran is one band per width; a job has the same colour and label in every panel. A background job lent a running
job's idle ranks holds no slot of its own: it is drawn hatched on rows above the cluster's ("lent").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deeppool.cluster_sim.engine import SimResult
from deeppool.replay.live import LiveRecord, LiveRun

MAX_LABELLED_JOBS = 40


@dataclass(frozen=True, kw_only=True)
class Band:
    """Job ``job`` (its index in the slice) held ``gpus`` slots from ``start_s`` to ``end_s``."""

    job: int
    name: str
    gpus: int
    start_s: float
    end_s: float
    lent: bool = False
    """it ran on a running job's idle ranks (a guest), not on slots of its own"""


def live_bands(run: LiveRun) -> list[Band]:
    order = {record.job_id: index for index, record in enumerate(sorted(run.records, key=_submission))}
    return [Band(job=order[r.job_id], name=r.job.name, gpus=gpus, start_s=start, end_s=end,
                 lent=_lent(r, start, end))
            for r in run.records for start, end, gpus in (r.widths or [(a, b, r.job.gpus) for a, b in r.held])]


def _lent(record: LiveRecord, start: float, end: float) -> bool:
    """Whether the held interval around ``start``..``end`` ran on a host's lent ranks."""
    return any(host is not None and a <= start + 1e-9 and end <= b + 1e-9
               for (a, b), host in zip(record.held, record.hosts, strict=False))


def simulated_bands(result: SimResult) -> list[Band]:
    return [Band(job=r.job_id, name=r.name, gpus=r.gpus, start_s=r.start_s, end_s=r.finish_s) for r in result.records]


def _submission(record: LiveRecord) -> tuple[float, int]:
    return record.submitted_s, record.job_id


def place(bands: Sequence[Band], slots: int) -> list[tuple[Band, list[int]]]:
    """Each band with the slots it is drawn on (first fit); a band that fits nowhere goes above the cluster, and
    a lent band on the rows above it (first fit there)."""
    free_at = [0.0] * slots
    lent_free_at: list[float] = []
    placed = []
    for band in sorted(bands, key=lambda b: (b.start_s, b.job)):
        if band.lent:
            row = next((i for i, at in enumerate(lent_free_at) if at <= band.start_s + 1e-6), len(lent_free_at))
            lent_free_at[len(lent_free_at):] = [0.0] * (row + 1 - len(lent_free_at))
            lent_free_at[row] = band.end_s
            placed.append((band, [slots + row]))
            continue
        fitting = [slot for slot in range(slots) if free_at[slot] <= band.start_s + 1e-6]
        chosen = fitting[:band.gpus] if len(fitting) >= band.gpus else list(range(slots, slots + band.gpus))
        for slot in chosen:
            if slot < slots:
                free_at[slot] = band.end_s
        placed.append((band, chosen))
    return placed


def _colour(job: int) -> int:
    """tab20's dark shades for jobs 0-9, then its light ones, so neighbours in submission order differ."""
    return (2 * job) % 20 + (job // 10) % 2


def draw(panels: Sequence[tuple[str, Sequence[Band]]], slots: int, path: Path) -> None:
    """One panel per (title, bands), on one time axis, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = max((band.job for _, bands in panels for band in bands), default=0) + 1
    colours = plt.get_cmap("tab20")
    figure, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, figsize=(11, 1.0 + (0.6 * slots + 0.6) * len(panels)))
    for axis, (title, bands) in zip(axes[:, 0], panels, strict=True):
        placed = place(bands, slots)
        for band, chosen in placed:
            for slot in chosen:
                axis.broken_barh([(band.start_s, band.end_s - band.start_s)], (slot + 0.05, 0.9),
                                 facecolors=colours(_colour(band.job)), edgecolors="black", linewidth=0.4,
                                 hatch="///" if band.lent else None)
            if jobs <= MAX_LABELLED_JOBS:
                axis.text((band.start_s + band.end_s) / 2, min(chosen) + 0.5, str(band.job), ha="center",
                          va="center", fontsize=7)
        axis.set_title(title, fontsize=10, loc="left")
        rows = max([slots] + [max(chosen) + 1 for _, chosen in placed])
        lent_rows = {row for band, chosen in placed if band.lent for row in chosen}
        axis.set_ylim(0, rows)
        axis.set_yticks([slot + 0.5 for slot in range(rows)],
                        [str(slot) if slot < slots else "lent" if slot in lent_rows else "" for slot in range(rows)])
        axis.set_ylabel("slot")
    axes[-1, 0].set_xlabel("seconds from the first submission (bands: jobs, numbered in submission order)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
