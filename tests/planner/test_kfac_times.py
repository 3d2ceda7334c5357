"""K-FAC's work timed at plan time by the preconditioner itself, on stand-alone modules of each layer's kind and
shape (:mod:`deeppool.planner.profiling.kfac_times`)."""

from __future__ import annotations

import torch
from torch import nn

from deeppool.model.loading import LoadedModel, default_loss
from deeppool.model.trace import trace
from deeppool.planner.profiling.kfac_times import KfacLayer, kfac_layers, measure_kfac
from deeppool.planner.solve.kfac import preconditioned_layers


def _traced(module: nn.Module, sample: tuple[int, ...]):
    loaded = LoadedModel(module=module, inputs=lambda b: (torch.randn(b, *sample),), targets=lambda b: None,
                         loss=default_loss)
    return trace(loaded)


def test_each_layer_is_rebuilt_with_its_kind_kernel_stride_padding_and_positions() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 5, bias=False),
                          nn.Flatten(), nn.Linear(4 * 4 * 4, 10))
    traced = _traced(model, (3, 15, 15))
    names = tuple(preconditioned_layers(traced.graph))
    layers = kfac_layers(traced.graph, names, traced.module)
    first, second, last = (layers[name] for name in names)
    assert first == KfacLayer(kind="Conv2d", inputs=3, outputs=8, bias=True, sample_shape=(3, 15, 15), kernel=(3, 3),
                              stride=(2, 2), padding=(1, 1))
    assert (second.kernel, second.bias, second.sample_shape) == ((5, 5), False, (8, 8, 8))
    assert last == KfacLayer(kind="Linear", inputs=64, outputs=10, bias=True, sample_shape=(64,))
    by_name = {layer.name: layer for layer in traced.graph.layers}
    for name, layer in layers.items():  # the stand-alone module gives the traced layer's output: its positions
        out = layer.build()(torch.zeros(1, *layer.sample_shape))
        assert tuple(out.shape[1:]) == by_name[name].output_shape


def test_times_grow_with_the_layer_and_a_convolution_s_statistics_cover_its_positions() -> None:
    small = KfacLayer(kind="Linear", inputs=27, outputs=8, bias=True, sample_shape=(27,))
    conv = KfacLayer(kind="Conv2d", inputs=3, outputs=8, bias=True, sample_shape=(3, 32, 32), kernel=(3, 3),
                     padding=(1, 1))
    big = KfacLayer(kind="Linear", inputs=512, outputs=512, bias=True, sample_shape=(512,))
    times = measure_kfac({"small": small, "conv": conv, "big": big, "again": small}, 32, threads=1, rounds=3)
    assert times["again"] is times["small"]  # one shape timed once
    assert min(times["small"].inverses_ms, times["small"].precondition_ms) > 0
    assert times["big"].inverses_ms > 4 * times["small"].inverses_ms
    assert times["big"].precondition_ms > 4 * times["small"].precondition_ms
    # the same factors (a = 28, o = 8) over 1,024 unfolded positions a sample instead of one row
    assert times["conv"].statistics_ms > 5 * times["small"].statistics_ms > 0
    assert abs(times["conv"].inverses_ms - times["small"].inverses_ms) < times["big"].inverses_ms
