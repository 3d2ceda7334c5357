"""K-FAC's factors and preconditioned gradients against closed forms worked out by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional

from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.errors import DeeppoolError


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)


def _regression(rows: int = 6) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 2), torch.randn(rows, 3), torch.randn(rows, 2)


def _mse_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """The batch-mean loss ½|z − y|² averaged over the rows: sample i's output gradient is z_i − y_i."""
    model.zero_grad()
    (0.5 * ((model(x) - y) ** 2).sum(dim=1)).mean().backward()


def test_linear_factors_are_the_second_moments_of_inputs_and_per_sample_output_gradients() -> None:
    model, x, y = _regression()
    pre = KFACPreconditioner(model, KfacOptions(kl_clip=None))
    _mse_step(model, x, y)
    residual = (model(x) - y).detach()          # ∂ℓ_i/∂z_i for ℓ_i = ½|z_i − y_i|²
    a_rows = _with_ones(x)
    expected_a = sum(torch.outer(row, row) for row in a_rows) / len(x)
    expected_g = sum(torch.outer(row, row) for row in residual) / len(x)
    pre.step()
    a, g = pre.factors("")
    torch.testing.assert_close(a, expected_a)
    torch.testing.assert_close(g, expected_g)


def test_the_preconditioned_gradient_is_the_damped_kronecker_solve() -> None:
    model, x, y = _regression()
    damping = 0.05
    pre = KFACPreconditioner(model, KfacOptions(damping=damping, kl_clip=None))
    _mse_step(model, x, y)
    grad = torch.cat([model.weight.grad, model.bias.grad[:, None]], dim=1).clone()
    pre.step()
    a, g = pre.factors("")
    eye = torch.eye
    expected = torch.linalg.inv(g + damping * eye(2)) @ grad @ torch.linalg.inv(a + damping * eye(4))
    torch.testing.assert_close(model.weight.grad, expected[:, :3], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.bias.grad, expected[:, 3], rtol=1e-4, atol=1e-6)


def test_running_averages_and_update_intervals() -> None:
    model, x, y = _regression()
    decay = 0.5
    pre = KFACPreconditioner(model, KfacOptions(factor_decay=decay, factor_update_steps=2, inv_update_steps=4,
                                                kl_clip=None))
    seen = []
    for step in range(3):
        batch = x * (step + 1)
        _mse_step(model, batch, y)
        seen.append(sum(torch.outer(r, r) for r in _with_ones(batch)) / len(batch))
        pre.step()
    a, _ = pre.factors("")
    torch.testing.assert_close(a, decay * seen[0] + (1 - decay) * seen[2])   # steps 0 and 2 update, not 1


def test_kl_clipping_scales_by_nu() -> None:
    model, x, y = _regression()
    lr, kl_clip = 0.5, 1e-4
    reference = KFACPreconditioner(model, KfacOptions(kl_clip=None), lr=lr)
    _mse_step(model, x, y)
    raw = model.weight.grad.clone(), model.bias.grad.clone()
    reference.step()
    unclipped = model.weight.grad.clone(), model.bias.grad.clone()
    reference.remove()
    clipped = KFACPreconditioner(model, KfacOptions(kl_clip=kl_clip), lr=lr)
    _mse_step(model, x, y)
    clipped.step()
    total = sum(float((v * r).sum()) for v, r in zip(unclipped, raw, strict=True)) * lr ** 2
    nu = min(1.0, math.sqrt(kl_clip / abs(total)))
    assert nu < 1
    torch.testing.assert_close(model.weight.grad, unclipped[0] * nu)
    torch.testing.assert_close(model.bias.grad, unclipped[1] * nu)


def _patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Each sample's input patches at each output position, by explicit slicing (samples, positions, C·k·k)."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    padded = functional.pad(x, (pw, pw, ph, ph))
    out_h, out_w = (padded.shape[2] - kh) // sh + 1, (padded.shape[3] - kw) // sw + 1
    rows = [padded[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw].reshape(x.shape[0], -1)
            for i in range(out_h) for j in range(out_w)]
    return torch.stack(rows, dim=1)


def test_conv2d_factors_follow_kfc_over_the_unfolded_patches() -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(27, 4))
    x, y = torch.randn(5, 2, 6, 6), torch.randint(0, 4, (5,))
    pre = KFACPreconditioner(model, KfacOptions(kl_clip=None))
    out = conv(x)
    out.retain_grad()
    functional.cross_entropy(model[2](model[1](out)), y).backward()
    pre.step()
    rows, positions = len(x), out.shape[2] * out.shape[3]
    patches = torch.cat([_patches(x, conv), torch.ones(rows, positions, 1)], dim=2).reshape(-1, 19)
    grads = out.grad.permute(0, 2, 3, 1).reshape(-1, 3)
    a, g = pre.factors("0")
    torch.testing.assert_close(a, patches.t() @ patches / rows)
    torch.testing.assert_close(g, grads.t() @ grads * rows / positions)


def test_a_conv2d_over_its_whole_input_is_a_linear_layer() -> None:
    torch.manual_seed(2)
    conv, linear = nn.Conv2d(2, 3, 4), nn.Linear(32, 3)
    linear.weight.data.copy_(conv.weight.data.reshape(3, 32))
    linear.bias.data.copy_(conv.bias.data)
    x, y = torch.randn(6, 2, 4, 4), torch.randn(6, 3)
    conv_pre, linear_pre = (KFACPreconditioner(m, KfacOptions(damping=0.1, kl_clip=None)) for m in (conv, linear))
    _mse_step(nn.Sequential(conv, nn.Flatten()), x, y)
    _mse_step(linear, x.reshape(6, 32), y)
    conv_pre.step()
    linear_pre.step()
    for got, want in zip(conv_pre.factors(""), linear_pre.factors(""), strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(conv.weight.grad.reshape(3, 32), linear.weight.grad, rtol=1e-4, atol=1e-5)


def _train(model: nn.Module, opt: torch.optim.Optimizer, pre: KFACPreconditioner, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 2, 5, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 16), nn.Tanh(),
                         nn.LayerNorm(16), nn.Linear(16, 3))


def test_state_round_trip_resumes_bit_identically() -> None:
    options = KfacOptions(factor_update_steps=2, inv_update_steps=3)
    whole = _net()
    opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(whole, options)
    _train(whole, opt, pre, range(4))
    saved = copy.deepcopy([whole.state_dict(), opt.state_dict(), pre.state_dict()])
    _train(whole, opt, pre, range(4, 8))
    resumed = _net()
    resumed.load_state_dict(saved[0])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved[1])
    pre2 = KFACPreconditioner(resumed, options)
    pre2.load_state_dict(saved[2])
    assert pre2.layers == ("0", "3", "6")          # the LayerNorm keeps its plain gradient
    _train(resumed, opt2, pre2, range(4, 8))
    for (name, got), want in zip(resumed.state_dict().items(), whole.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_options_are_checked() -> None:
    with pytest.raises(DeeppoolError, match="--kfac-factor-decay"):
        KfacOptions(factor_decay=1.0)
    with pytest.raises(DeeppoolError, match="at least 1 step"):
        KfacOptions(inv_update_steps=0)
    with pytest.raises(DeeppoolError, match="only Linear and Conv2d"):
        KFACPreconditioner(nn.Sequential(nn.LayerNorm(3)), groups={"0": (0,)})
