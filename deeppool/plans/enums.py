"""The closed sets a plan names: precision, optimizer, strategy, objective and gradient combination."""

from __future__ import annotations

import enum

from deeppool.errors import DeeppoolError

FLOAT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the floating dtypes a layer may hold, by torch's name."""


class Precision(enum.Enum):
    """The arithmetic a model trains in: it sets the device's peak and the bytes per element.

    A run trains in fp32 or autocasts its forward to bf16 or fp16 (parameters and optimizer state stay fp32);
    TF32 is fp32 storage with TF32 tensor-core products, a planning figure that a run gets from torch's own
    TF32 settings.
    """

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def element_bytes(self) -> int:
        return 2 if self in (Precision.BF16, Precision.FP16) else 4

    def scale(self, dtype: str) -> float:
        """Bytes in this precision per byte of a traced ``dtype`` tensor (integer tensors keep theirs)."""
        size = FLOAT_BYTES.get(dtype)
        return 1.0 if size is None else self.element_bytes / size

    @property
    def scaled(self) -> bool:
        """fp16 needs its loss scaled, so small gradients do not flush to zero."""
        return self is Precision.FP16

    @property
    def check_bound(self) -> float:
        """``--check``'s default bound: round-off of this precision's products, with a margin
        (measured figures in docs/executor.md, "Mixed precision")."""
        return {Precision.FP16: 1e-2, Precision.BF16: 5e-2}.get(self, 1e-3)

    @property
    def check_floor(self) -> float:
        """``--check``'s floor for a tensor's norm, as a fraction of the largest of its kind: a gradient that
        cancels exactly (a bias right before BatchNorm) comes out as this precision's round-off of the
        large terms, so the floor grows with the precision's epsilon (docs/executor.md, "Mixed precision")."""
        return {Precision.FP16: 2e-2, Precision.BF16: 1e-1}.get(self, 1e-3)

    @classmethod
    def of_dtype(cls, dtype: str) -> Precision:
        """The precision a tensor dtype trains in by default (fp32 matmuls do not use TF32 in PyTorch)."""
        return {"bfloat16": cls.BF16, "float16": cls.FP16}.get(dtype, cls.FP32)

    @classmethod
    def of_profile(cls, text: str) -> Precision:
        """A profile's precision: its name, or (older profiles) the dtype it was measured in."""
        try:
            return cls(text)
        except ValueError:
            return cls.of_dtype(text)

    @classmethod
    def parse(cls, text: str) -> Precision:
        try:
            return cls(text.lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise DeeppoolError(f"--precision '{text}' is not one of {names}") from None


class Optimizer(enum.Enum):
    """The optimizer the plan is for: it sets optimizer state memory and step time."""

    SGD = "sgd"
    ADAM = "adam"
    KFAC = "kfac"
    """SGD (``--momentum``) on gradients preconditioned by K-FAC (:mod:`deeppool.adaptation.kfac`): its
    factors, inverses and their communication are priced per layer, beyond SGD's step."""

    @property
    def base(self) -> Optimizer:
        """The first-order optimizer that steps (K-FAC's is SGD)."""
        return Optimizer.SGD if self is Optimizer.KFAC else self

    @classmethod
    def first_order(cls) -> tuple[Optimizer, ...]:
        """The optimizers that step (each its own :attr:`base`): the ones whose steps are measured."""
        return tuple(optimizer for optimizer in cls if optimizer.base is optimizer)

    @property
    def state_factor(self) -> int:
        """Optimizer state bytes per parameter byte (SGD without momentum: none; Adam: two moments)."""
        return {Optimizer.SGD: 0, Optimizer.ADAM: 2}[self.base]

    def step_traffic(self, param_bytes: float) -> float:
        """Bytes a step streams over ``param_bytes`` of parameters: read the weights and gradients, write the
        weights, and read and write each state tensor."""
        return (3 + 2 * self.state_factor) * param_bytes


class Strategy(enum.Enum):
    """Which plan is written: the ILP optimum or one of its baselines."""

    ILP = "ilp"
    DATA_PARALLEL = "dp"
    BEST_DATA_PARALLEL = "best-dp"
    DEEPPOOL = "deeppool"


class Objective(enum.Enum):
    """The iteration time; DeepPool's time + price · GPU-time; or the cluster's throughput (foreground
    share plus the background work the plan's idle windows hold, :mod:`deeppool.planner.solve.throughput`)."""

    TIME = "time"
    TIME_AND_GPU_TIME = "time+gpu-time"
    CLUSTER = "cluster"


class Combine(enum.Enum):
    SUM = "sum"
    """The all-reduce sum of the ranks' pre-scaled gradients: the gradient of the global mean loss."""
    ADASUM = "adasum"
    """Adasum (Maleki et al., MLSys 2021) of the ranks' own mean gradients, per layer; any group size
    (a group that is not a power of two folds its extra ranks in first: :mod:`deeppool.adaptation.adasum`)."""
