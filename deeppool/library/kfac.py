"""``deeppool.kfac(model, ...)``: K-FAC for the user's own loop, between ``bp.step(...)`` and ``opt.step()``.

Named and defaulted as kfac-pytorch's ``KFACPreconditioner``; see :mod:`deeppool.adaptation.kfac` for the
factors, the damping convention and how a burst plan's groups share the work.
"""

from __future__ import annotations

import torch
from torch import nn

from deeppool.adaptation.kfac import KFACPreconditioner, Rate
from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.library.parallel import Parallelized


def kfac(model: nn.Module | Parallelized, *, lr: Rate = 0.1, damping: float = 0.001, factor_decay: float = 0.95,
         factor_update_steps: int = 1, inv_update_steps: int = 10, kl_clip: float | None = 0.001,
         grad_scaler: torch.amp.GradScaler | None = None) -> KFACPreconditioner:
    """A K-FAC preconditioner for ``model`` (a ``deeppool.parallelize`` result, or a plain module).

    Call its ``step()`` once per optimizer step, after the backward (``bp.step``; after ``scaler.unscale_``
    under a ``GradScaler``, given as ``grad_scaler``) and before clipping and ``opt.step()``: it replaces
    the gradients of the ``Linear`` and ``Conv2d`` modules by their preconditioned gradients. ``lr``
    (the optimizer's) only enters KL clipping. The loss must be the mean over the step's samples.
    """
    options = KfacOptions(damping=damping, factor_decay=factor_decay, factor_update_steps=factor_update_steps,
                          inv_update_steps=inv_update_steps, kl_clip=kl_clip)
    scale = grad_scaler.get_scale if grad_scaler is not None else None
    if isinstance(model, Parallelized):
        return model.kfac(options, lr=lr, grad_scaler=scale)
    return KFACPreconditioner(model, options, lr=lr, grad_scaler=scale)
