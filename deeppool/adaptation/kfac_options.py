"""K-FAC's hyperparameters (:mod:`deeppool.adaptation.kfac`), named as kfac-pytorch's ``KFACPreconditioner``
names them; each is a ``deeppool run`` option (``--kfac-damping``...). Free of torch, so the CLI checks them
without loading it."""

from __future__ import annotations

from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.options import option


@dataclass(frozen=True, kw_only=True)
class KfacOptions:
    """How K-FAC preconditions (the learning rate, which KL clipping uses, is the optimizer's)."""

    damping: float = option(0.001, help="K-FAC: λ added to each Kronecker factor before inverting")
    factor_decay: float = option(0.95, help="K-FAC: running-average decay of the factors")
    factor_update_steps: int = option(1, help="K-FAC: optimizer steps between factor updates")
    inv_update_steps: int = option(10, help="K-FAC: optimizer steps between eigendecompositions of the factors")
    kl_clip: float | None = option(0.001, help="K-FAC: KL clipping bound on the preconditioned step")
    """None: no KL clipping."""

    def __post_init__(self) -> None:
        if not 0 <= self.factor_decay < 1:
            raise DeeppoolError(f"--kfac-factor-decay {self.factor_decay} must be in [0, 1)")
        if self.factor_update_steps < 1 or self.inv_update_steps < 1:
            raise DeeppoolError(
                f"K-FAC update intervals must be at least 1 step, got --kfac-factor-update-steps "
                f"{self.factor_update_steps} and --kfac-inv-update-steps {self.inv_update_steps}"
            )
        if self.kl_clip is not None and self.kl_clip <= 0:
            raise DeeppoolError(f"--kfac-kl-clip {self.kl_clip} must be positive")
        if self.damping < 0:
            raise DeeppoolError(f"--kfac-damping {self.damping} must not be negative")
