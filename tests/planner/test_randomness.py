"""Per-sample randomness: draws depend on (seed, step, ordinal, sample), never on the split."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deeppool.errors import DeeppoolError
from deeppool.model.randomness import RandomCall, SampleRandomness, batched_calls, sample_seed

SEED = 1234


def run(mode: SampleRandomness, fn: Callable[[], torch.Tensor], *, step: int = 0, offset: int = 0) -> torch.Tensor:
    with mode.at(step=step, offset=offset, ordinal=0):
        return fn()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4))


Layer = Callable[[torch.Tensor], torch.Tensor]
Result = tuple[torch.Tensor, torch.Tensor]


def forward_and_grad(fn: Layer, mode: SampleRandomness, x: torch.Tensor, offset: int) -> Result:
    """Output and input gradient of rows ``[offset, offset + n)``; the upstream gradient follows the global row."""
    x = x.clone().requires_grad_(True)
    y = run(mode, lambda: fn(x), offset=offset)
    rows, cols = y.shape
    y.backward(torch.arange(offset * cols, (offset + rows) * cols, dtype=y.dtype, device=y.device).reshape(rows, cols))
    assert x.grad is not None
    return y.detach(), x.grad


def split_runs(fn: Layer, x: torch.Tensor) -> tuple[Result, Result]:
    """(output, input gradient) of all 6 rows at offset 0, then rows 0:2 and 2:6 concatenated."""
    mode = SampleRandomness(seed=SEED, batched={0: True})
    whole = forward_and_grad(fn, mode, x, 0)
    head, tail = forward_and_grad(fn, mode, x[:2], 0), forward_and_grad(fn, mode, x[2:], 2)
    return whole, (torch.cat([head[0], tail[0]]), torch.cat([head[1], tail[1]]))


def test_dropout_is_split_invariant_bit_for_bit() -> None:
    whole, split = split_runs(lambda x: F.dropout(x, 0.5), torch.randn(6, 8))
    assert torch.equal(whole[0], split[0])
    assert torch.equal(whole[1], split[1])


def test_model_is_split_invariant() -> None:
    """The masks match bit for bit; the Linear layers' BLAS may round differently per batch size."""
    net = model()
    dropped: list[torch.Tensor] = []
    net[1].register_forward_hook(lambda module, inputs, output: dropped.append(output.detach() == 0))
    whole, split = split_runs(net, torch.randn(6, 8))
    assert torch.equal(dropped[0], torch.cat(dropped[1:]))
    torch.testing.assert_close(whole[0], split[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(whole[1], split[1], rtol=0, atol=1e-6)


def test_dropout_gradient_is_the_mask() -> None:
    x = torch.ones(6, 10, requires_grad=True)
    y = run(SampleRandomness(seed=SEED, batched={0: True}), lambda: F.dropout(x, 0.5))
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, y.detach())


def test_native_dropout_is_split_invariant_with_its_mask() -> None:
    x = torch.randn(6, 5)
    mode = SampleRandomness(seed=SEED, batched={0: True})
    whole = run(mode, lambda: torch.ops.aten.native_dropout(x, 0.5, True))
    head = run(mode, lambda: torch.ops.aten.native_dropout(x[:2], 0.5, True))
    tail = run(mode, lambda: torch.ops.aten.native_dropout(x[2:], 0.5, True), offset=2)
    for index in range(2):
        assert torch.equal(whole[index], torch.cat([head[index], tail[index]]))
    whole_out, split_out = split_runs(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0], x)
    assert torch.equal(whole_out[0], split_out[0])
    assert torch.equal(whole_out[1], split_out[1])


def test_per_sample_outputs_keep_the_ops_memory_layout() -> None:
    """native_dropout of a transposed tensor is transposed; code may ``view`` it as such (HF ViT's attention)."""
    x = torch.randn(6, 4, 5).transpose(1, 2)
    eager = torch.ops.aten.native_dropout(x, 0.5, True)
    drawn = run(SampleRandomness(seed=SEED, batched={0: True}), lambda: torch.ops.aten.native_dropout(x, 0.5, True))
    for ours, theirs in zip(drawn, eager, strict=True):
        assert ours.stride() == theirs.stride()
    drawn[0].transpose(1, 2).view(6, -1)  # raises if the layout were contiguous


def test_per_sample_outputs_take_the_ops_layout_not_their_arguments() -> None:
    """An op whose output is laid out unlike its first argument: ``randn_like`` asked for a contiguous tensor of a
    transposed one is contiguous, so the model's ``view`` of it works eagerly (issue 22 item 3: "view size is not
    compatible with input tensor's size and stride" in the pre-training check)."""
    x = torch.randn(6, 4, 5).transpose(1, 2)
    mode = SampleRandomness(seed=SEED, batched={0: True})
    noise = run(mode, lambda: torch.randn_like(x, memory_format=torch.contiguous_format))
    assert noise.stride() == torch.randn_like(x, memory_format=torch.contiguous_format).stride()
    assert noise.view(6, -1).shape == (6, 20)


def test_per_sample_attention_keeps_every_output_layout() -> None:
    """Flash attention on the CPU (dropout 0) is seeded: its output follows the query, its logsumexp is laid out
    [batch, sequence, heads] whatever the query."""
    q = torch.randn(6, 5, 2, 8).transpose(1, 2)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    eager = op(q, q, q, 0.0, False)
    drawn = run(SampleRandomness(seed=SEED, batched={0: True}), lambda: op(q, q, q, 0.0, False))
    for ours, theirs in zip(drawn, eager, strict=True):
        assert ours.stride() == theirs.stride()
        torch.testing.assert_close(ours, theirs)


def masks(mode: SampleRandomness, step: int) -> torch.Tensor:
    return run(mode, lambda: F.dropout(torch.ones(6, 32), 0.5), step=step)


def test_samples_steps_and_fresh_modes() -> None:
    first = masks(SampleRandomness(seed=SEED, batched={0: True}), step=3)
    rows = {tuple(row.tolist()) for row in first}
    assert len(rows) == 6
    assert not torch.equal(first, masks(SampleRandomness(seed=SEED, batched={0: True}), step=4))
    assert torch.equal(first, masks(SampleRandomness(seed=SEED, batched={0: True}), step=3))
    assert not torch.equal(first, masks(SampleRandomness(seed=SEED + 1, batched={0: True}), step=3))


def test_ordinal_advances_and_separates_calls() -> None:
    mode = SampleRandomness(seed=SEED, batched={0: True, 1: True})
    x = torch.ones(4, 16)
    with mode.at(step=0, offset=0, ordinal=0):
        first, second = F.dropout(x, 0.5), F.dropout(x, 0.5)
    assert mode.ordinal == 2
    assert not torch.equal(first, second)
    with mode.at(step=0, offset=0, ordinal=1):
        assert torch.equal(second, F.dropout(x, 0.5))


def split_equal(fn: Callable[[int], torch.Tensor]) -> None:
    """``fn(rows)`` at offset 0 on 5 rows equals rows 0:2 and 2:5 drawn separately."""
    mode = SampleRandomness(seed=SEED, batched={0: True})
    whole = run(mode, lambda: fn(5))
    parts = run(mode, lambda: fn(2)), run(mode, lambda: fn(3), offset=2)
    assert whole.shape[0] == 5
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize(
    "fn",
    [
        lambda rows: torch.rand_like(torch.zeros(rows, 3)),
        lambda rows: torch.randn(rows, 5),
        lambda rows: torch.randint(0, 100, (rows, 4)),
        lambda rows: torch.zeros(rows, 7).bernoulli_(0.3),
        lambda rows: torch.empty(rows, 3).uniform_(),
        lambda rows: torch.normal(torch.zeros(rows, 3), 1.0),
        lambda rows: torch.rand(rows, 2, generator=torch.Generator().manual_seed(5)),
        lambda rows: torch.rand(rows, 2, out=torch.empty(rows, 2)),
    ],
    ids=["rand_like", "randn", "randint", "bernoulli_", "uniform_", "normal", "generator", "out"],
)
def test_batched_ops_are_split_invariant(fn: Callable[[int], torch.Tensor]) -> None:
    split_equal(fn)


def test_written_arguments_are_returned_and_filled() -> None:
    x, buffer = torch.zeros(4, 6), torch.zeros(4, 6)
    mode = SampleRandomness(seed=SEED, batched={0: True})
    assert run(mode, lambda: x.uniform_()) is x
    assert run(mode, lambda: torch.rand(4, 6, out=buffer)) is buffer
    assert torch.equal(x, buffer)


def test_shared_call_is_the_same_everywhere_and_seeded_by_step() -> None:
    mode = SampleRandomness(seed=SEED, batched={0: False})
    here = run(mode, lambda: torch.rand(5), offset=0)
    there = run(mode, lambda: torch.rand(5), offset=4)
    assert torch.equal(here, there)
    assert not torch.equal(here, run(mode, lambda: torch.rand(5), step=1))
    torch.manual_seed(sample_seed(SEED, 0, 0, -1))
    assert torch.equal(here, torch.rand(5))


def test_shared_call_on_a_batch_shaped_tensor_runs_once() -> None:
    mode = SampleRandomness(seed=SEED, batched={0: False})
    x = torch.zeros(4, 3)
    out = run(mode, lambda: torch.rand_like(x))
    torch.manual_seed(sample_seed(SEED, 0, 0, -1))
    assert torch.equal(out, torch.rand(4, 3))


def test_recording_counts_and_sizes_without_changing_draws() -> None:
    def body(rows: int) -> torch.Tensor:
        x = torch.ones(rows, 8)
        return F.dropout(x, 0.5) + torch.randn(rows, 8) + torch.rand(8)

    probes = {}
    for rows in (2, 3):
        mode = SampleRandomness(seed=SEED)
        torch.manual_seed(7)
        recorded = run(mode, lambda rows=rows: body(rows))
        torch.manual_seed(7)
        assert torch.equal(recorded, body(rows))
        probes[rows] = mode.calls
    assert [call.ordinal for call in probes[2]] == [0, 1, 2]
    assert [call.rows for call in probes[3]] == [3, 3, 8]
    assert probes[2][1] == RandomCall(ordinal=1, op="aten.randn.default", rows=2)
    assert batched_calls(probes) == {0: True, 1: True, 2: False}


def test_probes_with_different_ops_are_refused() -> None:
    calls = [RandomCall(ordinal=0, op="aten.rand.default", rows=2)]
    with pytest.raises(DeeppoolError, match="differ"):
        batched_calls({2: calls, 3: []})


@pytest.mark.parametrize("batched", [True, False])
def test_global_rng_state_is_untouched(batched: bool) -> None:
    torch.manual_seed(99)
    before = torch.get_rng_state()
    run(SampleRandomness(seed=SEED, batched={0: batched}), lambda: F.dropout(torch.ones(4, 8), 0.5))
    assert torch.equal(before, torch.get_rng_state())


def test_unknown_ordinal_is_refused() -> None:
    mode = SampleRandomness(seed=SEED, batched={0: True})
    with pytest.raises(DeeppoolError, match="ordinal 1"):
        run(mode, lambda: torch.rand(2, 2) + torch.rand(2, 2))


def test_non_random_ops_pass_through() -> None:
    a, b = torch.randn(6, 8), torch.randn(8, 5)
    mode = SampleRandomness(seed=SEED, batched={})
    assert torch.equal(run(mode, lambda: torch.relu(a @ b)), torch.relu(a @ b))
    assert mode.ordinal == 0


def test_seed_mix_is_stable() -> None:
    """A golden value: every process and every Python run must derive the same seeds."""
    assert sample_seed(1234, 5, 2, 17) == 323980884804928933
    assert len({sample_seed(1, 2, 3, row) for row in range(-1, 100)}) == 101


def test_sample_draws_from_its_own_seed() -> None:
    whole = run(SampleRandomness(seed=SEED, batched={0: True}), lambda: torch.rand(4, 3), step=2, offset=10)
    torch.manual_seed(sample_seed(SEED, 2, 0, 13))
    assert torch.equal(whole[3:], torch.rand(1, 3))


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_dropout_is_split_invariant_and_leaves_the_device_rng_alone(device: str) -> None:
    """The same test on CPU (CI) and on a GPU: the generator comes through the device seam there. The
    input is drawn before the state is read (drawing it on the device advances the device's RNG)."""
    state = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    x = torch.randn(6, 8, device=device)
    before = state()
    whole, split = split_runs(lambda x: F.dropout(x, 0.5), x)
    assert torch.equal(whole[0], split[0])
    assert torch.equal(whole[1], split[1])
    assert torch.equal(before, state())


def test_ranks_run_as_threads_draw_their_own_samples() -> None:
    """The default generator is one per process: two threads seeding it for their own rows at once must not
    draw with each other's seeds (the tests' thread world runs ranks this way)."""
    x = torch.ones(4, 512)
    alone = {offset: run(SampleRandomness(seed=SEED, batched={0: True}), lambda: F.dropout(x, 0.5), offset=offset)
             for offset in (0, 4)}
    wrong: list[int] = []

    def rank(offset: int) -> None:
        mode = SampleRandomness(seed=SEED, batched={0: True})
        for _ in range(100):
            if not torch.equal(run(mode, lambda: F.dropout(x, 0.5), offset=offset), alone[offset]):
                wrong.append(offset)

    threads = [threading.Thread(target=rank, args=(offset,)) for offset in (0, 4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can, so a race shows
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []
