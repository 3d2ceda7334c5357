"""K-FAC's factors against an independent library: ASDL (``asdfghjkl``, the K-FAC authors' group).

ASDL's empirical-Fisher Kronecker factors (``FISHER_EMP``, ``SHAPE_KRON``) are, for a ``Linear``, ``A``
without the bias row and column and ``G`` as here; for a ``Conv2d`` ASDL puts KFC's ``1/L`` (``L`` output
positions) on ``A`` instead of ``G``, so its ``A`` is ours over ``L`` and its ``G`` ours times ``L``: the
same ``A ⊗ G``.
"""

from __future__ import annotations

import asdl
import torch
from torch import nn
from torch.nn import functional

from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.adaptation.kfac_options import KfacOptions


def test_factors_match_asdl_empirical_fisher() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(27, 4))
    x, y = torch.randn(5, 2, 6, 6), torch.randint(0, 4, (5,))
    config = asdl.FisherConfig(fisher_type=asdl.FISHER_EMP, fisher_shapes=[asdl.SHAPE_KRON],
                               loss_type=asdl.LOSS_CROSS_ENTROPY, data_size=len(x))
    maker = asdl.get_fisher_maker(model, config)
    maker.setup_loss_call(functional.cross_entropy, maker.setup_model_call(model, x), y)
    maker.forward_and_backward()
    pre = KFACPreconditioner(model, KfacOptions(kl_clip=None))
    model.zero_grad()
    functional.cross_entropy(model(x), y).backward()
    pre.step()
    positions = 9
    conv_a, conv_g = pre.factors("0")
    linear_a, linear_g = pre.factors("3")
    torch.testing.assert_close(model[0].fisher.kron.A, conv_a[:-1, :-1] / positions)
    torch.testing.assert_close(model[0].fisher.kron.B, conv_g * positions)
    torch.testing.assert_close(model[3].fisher.kron.A, linear_a[:-1, :-1])
    torch.testing.assert_close(model[3].fisher.kron.B, linear_g)
