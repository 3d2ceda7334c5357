"""The read-only status page at ``/``: the jobs, and a GPU-by-time timeline of foreground and background work.

The timeline is drawn from the event log: a job holds its GPUs from each
move into RUNNING until the next move out of it. Foreground GPUs are stacked
below background ones. A guest in a foreground job's idle windows holds no
GPU of its own: it is drawn as a thin band over its host's time. The page is
plain HTML with an inline SVG, no script, so it renders anywhere. It needs no
token, so it shows no owners and no model paths. It shows the newest jobs, a
page at a time (an "older jobs" link), and draws the timeline of those jobs
from the events that moved them, so its cost does not grow with what the
jobs report.

A job that was resized (:mod:`deeppool.coordinator.elastic`) is drawn at the
width of each of its attempts, and its row lists its resizes (from → to GPUs,
what each cost), its measured speed model (iteration time per GPUs and batch,
its noise scale) and the guests it hosts.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from deeppool.coordinator.jobs import Job, JobEvent, JobKind, JobStatus, SpeedPoint, WidthChange
from deeppool.coordinator.report import age

WIDTH, HEIGHT, MARGIN = 900, 220, 40
COLOURS = {JobKind.FOREGROUND: "#3b6fb6", JobKind.BACKGROUND: "#e59b2d"}


@dataclass(frozen=True, kw_only=True)
class Interval:
    job: Job
    start: float
    end: float
    gpus: int
    """the GPUs it held then (a resize changes them)"""


def by_job(changes: Sequence[WidthChange]) -> dict[int, list[WidthChange]]:
    """Resizes grouped by job, in order."""
    found: dict[int, list[WidthChange]] = {}
    for change in changes:
        found.setdefault(change.job_id, []).append(change)
    return found


def width_at(job: Job, changes: Sequence[WidthChange], t: float) -> int:
    """The GPUs ``job`` held at ``t``: those of the last resize relaunched by then (a reverted one changes
    nothing), else those it started on."""
    width = changes[0].from_gpus if changes else job.held
    for change in changes:
        if change.relaunched_at is not None and change.relaunched_at <= t and change.to_gpus \
                and change.phase != "REVERTED":
            width = change.to_gpus
    return width


def intervals(jobs: Sequence[Job], events: dict[int, list[JobEvent]], now: datetime,
              resizes: Mapping[int, Sequence[WidthChange]] | None = None) -> list[Interval]:
    resizes = resizes or {}
    out = []
    for job in jobs:
        opened: float | None = None
        for event in events.get(job.id, []):
            if event.to_state is JobStatus.RUNNING:
                opened = event.at.timestamp()
            elif opened is not None:
                out.append(Interval(job=job, start=opened, end=event.at.timestamp(),
                                    gpus=width_at(job, resizes.get(job.id, ()), opened)))
                opened = None
        if opened is not None:
            out.append(Interval(job=job, start=opened, end=now.timestamp(),
                                gpus=width_at(job, resizes.get(job.id, ()), opened)))
    return out


def allocation(spans: Sequence[Interval], kind: JobKind, t: float) -> int:
    return sum(s.gpus for s in spans if s.job.kind is kind and s.job.host_id is None and s.start <= t < s.end)


def timeline(spans: Sequence[Interval], total_gpus: int) -> str:
    """An SVG: foreground and background GPUs held over time, stacked, with guests as bands."""
    if not spans:
        return f'<svg width="{WIDTH}" height="{HEIGHT}"><text x="{MARGIN}" y="{HEIGHT // 2}">no job has run yet</text></svg>'
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    span = max(t1 - t0, 1e-3)
    x = lambda t: MARGIN + (WIDTH - 2 * MARGIN) * (t - t0) / span  # noqa: E731
    y = lambda g: HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * g / max(total_gpus, 1)  # noqa: E731
    cuts = sorted({s.start for s in spans} | {s.end for s in spans})
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="GPUs held over time">',
             f'<line x1="{MARGIN}" y1="{y(0)}" x2="{WIDTH - MARGIN}" y2="{y(0)}" stroke="#444"/>',
             f'<line x1="{MARGIN}" y1="{y(total_gpus)}" x2="{WIDTH - MARGIN}" y2="{y(total_gpus)}" '
             f'stroke="#aaa" stroke-dasharray="4"/>',
             f'<text x="4" y="{y(total_gpus) + 4}" font-size="11">{total_gpus} GPUs</text>']
    for a, b in zip(cuts, cuts[1:]):
        fg = allocation(spans, JobKind.FOREGROUND, a)
        bg = allocation(spans, JobKind.BACKGROUND, a)
        for low, high, kind in ((0, fg, JobKind.FOREGROUND), (fg, fg + bg, JobKind.BACKGROUND)):
            if high > low:
                parts.append(f'<rect x="{x(a):.1f}" y="{y(high):.1f}" width="{max(x(b) - x(a), 0.5):.1f}" '
                             f'height="{y(low) - y(high):.1f}" fill="{COLOURS[kind]}"/>')
    for s in spans:
        if s.job.host_id is not None:
            parts.append(f'<rect x="{x(s.start):.1f}" y="{y(0) + 4}" width="{max(x(s.end) - x(s.start), 0.5):.1f}" '
                         f'height="6" fill="{COLOURS[JobKind.BACKGROUND]}"><title>job {s.job.id} in the idle windows '
                         f'of job {s.job.host_id}</title></rect>')
    parts.append(f'<text x="{MARGIN}" y="{HEIGHT - 8}" font-size="11">{datetime.fromtimestamp(t0, UTC):%H:%M:%S}</text>')
    parts.append(f'<text x="{WIDTH - MARGIN - 50}" y="{HEIGHT - 8}" font-size="11">'
                 f'{datetime.fromtimestamp(t1, UTC):%H:%M:%S} UTC</text>')
    parts.append("</svg>")
    return "".join(parts)


def adapted(job: Job, jobs: Sequence[Job], changes: Sequence[WidthChange], speeds: Sequence[SpeedPoint]) -> str:
    """A job's resizes, measured speed model and guests, as the page's cell shows them."""
    parts = []
    for change in changes:
        cost = "".join(f", {name} {seconds:.1f} s" for name, seconds in (
            ("checkpoint", change.checkpoint_s), ("plan", change.plan_s), ("restart", change.restart_s))
            if seconds is not None)
        cached = " (plan cached)" if change.plan_cached else ""
        parts.append(f"{change.from_gpus}&rarr;{change.to_gpus} GPUs {change.phase.lower()}{cost}{cached}")
    for point in speeds:
        noise = f", noise scale {point.gns:.0f}" if point.gns is not None else ""
        parts.append(f"{point.iteration_s:.3f} s/step on {point.gpus} at batch {point.batch}{noise}")
    guests = [str(other.id) for other in jobs if other.host_id == job.id and other.state is JobStatus.RUNNING]
    if guests:
        parts.append(f"hosts job{'s' * (len(guests) > 1)} {', '.join(guests)}")
    return "<br>".join(parts)


def render(jobs: Sequence[Job], events: dict[int, list[JobEvent]], total_gpus: int, now: datetime | None = None, *,
           total: int | None = None, older: int | None = None,
           resizes: Mapping[int, Sequence[WidthChange]] | None = None,
           speeds: Mapping[int, Sequence[SpeedPoint]] | None = None) -> str:
    """The page for ``jobs`` (of ``total`` in all); ``older``: the id the next page of older jobs comes before;
    ``resizes`` and ``speeds``: the jobs' resizes and measured speeds, by job."""
    now = now or datetime.now(UTC)
    resizes, speeds = resizes or {}, speeds or {}
    shown = len(jobs) if total is None or total == len(jobs) else f"{len(jobs)} of {total}"
    more = f"<p><a href='/?before={older}'>older jobs</a></p>" if older is not None else ""
    rows = "".join(
        f"<tr><td>{j.id}</td><td>{j.kind.value}</td><td class='{j.state.value.lower()}'>{j.state.value}</td>"
        f"<td>{j.held if j.host_id is None else 'windows of ' + str(j.host_id)}</td><td>{100 * j.progress:.0f}%</td>"
        f"<td>{age(j.created_at, now)}</td><td>{html.escape(j.reason or '')}</td>"
        f"<td>{adapted(j, jobs, resizes.get(j.id, ()), speeds.get(j.id, ()))}</td></tr>"
        for j in jobs)
    legend = "".join(f"<span style='color:{c}'>&#9632;</span> {k.name.lower()} " for k, c in COLOURS.items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>deeppool coordinator</title><style>
body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border-bottom:1px solid #ddd;padding:4px 10px;text-align:left}} .running{{color:#2a7}} .failed{{color:#c33}}
</style></head><body><h1>deeppool coordinator</h1>
<h2>GPUs over time</h2><p>{legend}(thin band: a background job in a foreground job's idle windows)</p>
{timeline(intervals(jobs, events, now, resizes), total_gpus)}
<h2>{shown} jobs</h2><table><tr><th>id</th><th>kind</th><th>state</th><th>GPUs</th><th>progress</th>
<th>age</th><th>last change</th><th>resizes, speed, guests</th></tr>{rows}</table>{more}</body></html>"""
