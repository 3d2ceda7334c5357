"""PyTorch Lightning: ``Trainer(strategy=DeeppoolStrategy("plan.json"))`` trains a ``LightningModule`` on a
burst plan, its ``training_step``, optimizers, schedulers, clipping, accumulation, logging and checkpoints
unchanged.

The strategy is a layer over :func:`deeppool.parallelize`. In ``setup`` it parallelizes the module the
plan was made for (the ``LightningModule``'s attribute ``module``, ``"model"`` by default), puts the
tensors the rank trains back into that module (so ``configure_optimizers``' ``self.parameters()``,
``state_dict`` and checkpoints see them, in their own names), and routes the module's ``forward`` to
:meth:`~deeppool.library.Parallelized.forward`: ``self.model(x)`` in ``training_step`` returns the whole
batch's output on every rank, and Lightning's ``loss.backward()`` runs the plan's backward and gradient
all-reduces. Validation and prediction run :meth:`~deeppool.library.Parallelized.eval_step`.
``gradient_clip_val`` clips by the whole model's norm, ``accumulate_grad_batches`` keeps the gradients of
all but the last micro-batch local (``no_sync``), and the plan, not a ``DistributedSampler``, decides which
rows a rank computes: every rank loads the same global batches (a seeded shuffle). 32-bit only.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deeppool.device.cuda import CudaGpu
from deeppool.errors import DeeppoolError
from deeppool.executor.config import DEFAULT_TIMEOUT_S, BatchNormMode
from deeppool.library.parallel import Options, Parallelized, parallelize
from deeppool.library.world import join
from deeppool.plans import Plan

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ModuleNotFoundError as missing:
    raise ModuleNotFoundError("deeppool.integrations.lightning needs Lightning: pip install 'deeppool[lightning]' "
                              "(the 'lightning' package)") from missing

_MEAN = ("mean", "avg")
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


class DeeppoolStrategy(ParallelStrategy):
    """Run a ``LightningModule``'s model on a burst plan (started by ``torchrun`` or ``deeppool run --script``).

    ``plan``: the plan (or its path) made for the module held in the ``LightningModule``'s attribute
    ``module``; ``example_inputs``, ``bucket_mb``, ``timeout_s`` and ``batchnorm`` as for
    :func:`deeppool.parallelize`.
    """

    def __init__(self, plan: Plan | str | Path, *, module: str = "model", example_inputs: Any = None,
                 bucket_mb: float = 25.0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 batchnorm: BatchNormMode = BatchNormMode.SYNC) -> None:
        self._precision = _WholeModelClipping(self)
        super().__init__()
        self._plan = plan if isinstance(plan, Plan) else Plan.load(Path(plan))
        self._attribute = module
        self._example_inputs = example_inputs
        self._options = Options(bucket_mb=bucket_mb, timeout_s=timeout_s, batchnorm=batchnorm)
        self._device: torch.device | None = None
        self._bp: Parallelized | None = None

    @property
    def parallelized(self) -> Parallelized:
        """The rank's :class:`~deeppool.library.Parallelized` (after the Trainer's setup)."""
        if self._bp is None:
            raise DeeppoolError("the strategy has not set up yet: the Trainer parallelizes the module in fit()")
        return self._bp

    # -- what Lightning asks of a strategy ------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        local = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local) if CudaGpu().available() else torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """False: Lightning adds no ``DistributedSampler`` (the plan gives each rank its rows of every layer,
        so every rank loads the same global batches)."""
        return False

    @property
    def precision_plugin(self) -> Precision:
        return self._precision

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and type(plugin) is not Precision and not isinstance(plugin, _WholeModelClipping):
            raise DeeppoolError(f"DeeppoolStrategy trains in 32-bit precision, not with {type(plugin).__name__}: "
                                "give the Trainer precision='32-true' (the default)")

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        self._device = join(self._plan.gpus, self._options.timeout_s)
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        if self._bp is None:
            self._bp = self._parallelize()
        super().setup(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized() or dist.get_world_size() == 1:
            return tensor
        name = reduce_op.lower() if isinstance(reduce_op, str) else None
        if name is not None and name not in _OPS:
            raise DeeppoolError(f"reduce_op '{reduce_op}' is not one of {', '.join(_OPS)}")
        result = tensor.detach().clone().float() if name in _MEAN else tensor.detach().clone()
        dist.all_reduce(result, op=_OPS[name] if name is not None else reduce_op, group=group)
        return result / dist.get_world_size(group) if name in _MEAN else result

    def barrier(self, name: str | None = None) -> None:
        del name
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's micro-batches before the last keep their gradients local (``bp.no_sync``)."""
        with self.parallelized.no_sync():
            yield

    # -- the layer over parallelize -------------------------------------------------------------
    def _parallelize(self) -> Parallelized:
        net = getattr(self.lightning_module, self._attribute, None)
        if not isinstance(net, nn.Module):
            raise DeeppoolError(f"the LightningModule has no module '{self._attribute}': give DeeppoolStrategy(plan, "
                                "module=NAME), NAME the attribute that holds the model the plan was made for")
        options = self._options
        bp = parallelize(net, self._plan, example_inputs=self._example_inputs, bucket_mb=options.bucket_mb,
                         timeout_s=options.timeout_s, batchnorm=options.batchnorm)
        _adopt(net, bp)
        return bp


class _WholeModelClipping(Precision):
    """Lightning's 32-bit precision, with ``gradient_clip_val`` clipping by the whole model's gradient norm
    (over every rank's parameters: ``bp.clip_grad_norm_``)."""

    def __init__(self, strategy: DeeppoolStrategy) -> None:
        super().__init__()
        self._strategy = strategy

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        del optimizer
        self._strategy.parallelized.clip_grad_norm_(float(clip_val))


def _adopt(net: nn.Module, bp: Parallelized) -> None:
    """``net``'s parameters and buffers become the ones ``bp`` trains on this rank (the others stay, unused),
    and calling ``net`` runs ``bp``: the differentiable :meth:`~Parallelized.forward` with gradients, else
    :meth:`~Parallelized.eval_step`, in ``net``'s mode."""
    for key, tensor in bp.held_tensors().items():
        owner_name, _, leaf = key.rpartition(".")
        owner = net.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = tensor
        elif leaf in owner._buffers:
            owner._buffers[leaf] = tensor
    net.forward = _routed(net, bp)


def _routed(net: nn.Module, bp: Parallelized) -> Callable[..., Any]:
    signature = inspect.signature(net.forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if bp.training != net.training:
            bp.train(net.training)
        return bp.forward(dict(signature.bind(*args, **kwargs).arguments))

    return forward
