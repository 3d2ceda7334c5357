"""From the measured batches to a layer's times at every batch the planner asks for: the line ``t(s) = a + b·s``
(least squares, ``a, b ≥ 0``), the measured medians where there are some, a per-sample time that never falls as
the batch shrinks, and how well the line fits (:class:`~deeppool.planner.profiling.profile.FitQuality`)."""

from __future__ import annotations

from collections.abc import Callable

from deeppool.planner.profiling.profile import FitQuality, LayerTimes
from deeppool.planner.profiling.stats import NOISE_FLOOR_MS, Measured


def fit_line(xs: tuple[int, ...], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x`` with ``a, b ≥ 0`` (through the origin from a single point)."""
    if len(xs) == 1:
        return 0.0, max(ys[0], 0.0) / xs[0]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return max(mean_y, 0.0), 0.0
    if intercept < 0:
        return 0.0, max(sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs), 0.0)
    return intercept, slope


def fit_layer(
    batches: tuple[int, ...], samples: list[Measured], targets: tuple[int, ...]
) -> tuple[LayerTimes, list[float]]:
    """A layer's fitted times at ``targets``, and the fit's relative errors at the measured points."""
    fits = [fit_line(batches, [getattr(s, name) for s in samples]) for name in ("fwd_ms", "bwd_ms")]
    errors = []
    for batch, sample in zip(batches, samples, strict=True):
        total = sample.fwd_ms + sample.bwd_ms
        predicted = sum(a + b * batch for a, b in fits)
        if total >= NOISE_FLOOR_MS:
            errors.append(abs(predicted - total) / total)
    times = LayerTimes(
        batches=targets,
        fwd_ms=tuple(fits[0][0] + fits[0][1] * t for t in targets),
        bwd_ms=tuple(fits[1][0] + fits[1][1] * t for t in targets),
    )
    return times, errors


def layer_times(
    batches: tuple[int, ...], samples: list[Measured], targets: tuple[int, ...],
    untrusted: Callable[[Measured], bool] = lambda _: False,
) -> tuple[LayerTimes, list[float]]:
    """A layer's times at ``targets``: the measured medians at the measured batches (the fitted line where
    the layer is below the timer's noise floor, and at the other targets), each with the spread of the
    measurement it rests on (the nearest measured batch's at a fitted one) and whether that measurement
    is ``untrusted``; the per-sample time never falls as the batch shrinks. Also the fit's relative errors."""
    fitted, errors = fit_layer(batches, samples, targets)
    by_batch = dict(zip(batches, samples, strict=True))
    fwd, bwd, spread, busy = [], [], [], []
    for index, target in enumerate(targets):
        sample = by_batch.get(target)
        near = by_batch[min(batches, key=lambda b: (abs(b - target), b))]
        if sample is not None and sample.fwd_ms + sample.bwd_ms >= NOISE_FLOOR_MS:
            fwd.append(sample.fwd_ms)
            bwd.append(sample.bwd_ms)
        else:
            fwd.append(fitted.fwd_ms[index])
            bwd.append(fitted.bwd_ms[index])
        spread.append(near.spread)
        busy.append(untrusted(near))
    _keep_gpu_time(targets, fwd, bwd)
    return LayerTimes(batches=targets, fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), spread=tuple(spread),
                      busy=tuple(busy)), errors


def _keep_gpu_time(batches: tuple[int, ...], fwd: list[float], bwd: list[float]) -> None:
    """Raise, in place, a time whose per-sample rate is below a larger batch's: on ``g`` GPUs a layer then
    never costs less GPU-time than on one (``g · t(⌈B/g⌉) ≥ t(B)``), whatever noise the medians carry."""
    floor = 0.0
    for index in reversed(range(len(batches))):
        total = fwd[index] + bwd[index]
        least = floor * batches[index]
        if total < least:
            if total > 0:
                fwd[index], bwd[index] = fwd[index] * least / total, bwd[index] * least / total
            else:
                fwd[index], bwd[index] = least / 2, least / 2
        floor = max(floor, (fwd[index] + bwd[index]) / batches[index])


def fit_quality(
    batches: tuple[int, ...], errors: list[list[float]], measured: dict[str, list[Measured]], bound: float
) -> FitQuality:
    flat = sorted(e for layer in errors for e in layer)
    spreads = [sample.spread for samples in measured.values() for sample in samples]
    return FitQuality(
        measured_batches=batches,
        error_p50=flat[len(flat) // 2] if flat else 0.0,
        error_p90=flat[min(int(0.9 * len(flat)), len(flat) - 1)] if flat else 0.0,
        noisy=sum(spread > bound for spread in spreads),
        measurements=len(spreads),
        spread_bound=bound,
        compared=len(flat),
    )
