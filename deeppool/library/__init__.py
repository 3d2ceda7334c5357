"""Library mode: a plan's burst parallelism inside the user's own training loop.

``bp = deeppool.parallelize(module, plan)`` on every rank of a ``torchrun`` (or ``deeppool run
--script``) job; ``bp.step(x, y, loss_fn)`` runs the executor's engine for one global batch and leaves
the gradients of the global mean loss on ``bp.parameters()`` for the user's optimizer. See
``docs/library.md``.
"""

from deeppool.library.kfac import kfac
from deeppool.library.parallel import Options, Parallelized, parallelize

__all__ = ["Options", "Parallelized", "kfac", "parallelize"]
