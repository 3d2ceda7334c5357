"""The coordinator's job model: request and response types, states, and which moves between them are legal.

A job moves PENDING → STARTING → RUNNING → SUCCEEDED | FAILED, may be
CANCELLED from any live state, and a background job preempted for a
foreground one goes back to PENDING (requeued, not failed). A running job
that is resized (:mod:`deeppool.coordinator.elastic`) goes back to STARTING
for its attempt on the new GPU count. Terminal states
are final. The store (:mod:`deeppool.coordinator.store`) applies each move as
a compare-and-swap against :data:`TRANSITIONS` and records it in an
append-only event log with its reason.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class JobKind(enum.Enum):
    FOREGROUND = "fg"  # a burst-parallel plan on the GPUs it is granted
    BACKGROUND = "bg"  # single-GPU, low priority: idle windows of foreground jobs, or free GPUs


class JobStatus(enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.STARTING, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.STARTING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PENDING}),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PENDING,
                                  JobStatus.STARTING}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def sources(target: JobStatus) -> frozenset[JobStatus]:
    """The states a job may move to ``target`` from."""
    return frozenset(state for state, targets in TRANSITIONS.items() if target in targets)


def plain_text(value: str) -> str:
    """Text without NUL characters (no file name holds one); pydantic refuses lone surrogates already."""
    if "\x00" in value:
        raise ValueError("holds a NUL character")
    return value


PlainText = Annotated[str, AfterValidator(plain_text)]
InputDtype = Literal["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
REQUEST_FIELDS = ("kind", "model", "gpus", "batch", "steps", "amplification", "input_shape", "input_dtype",
                  "vocab_size", "script")
"""What makes two submissions the same job (an idempotency key reused with another of these is a conflict)."""


class JobRequest(BaseModel):
    """A submission, as the CLI and ``POST /v1/jobs`` give it. Unknown fields are refused (422).

    ``input_shape``, ``input_dtype`` and ``vocab_size`` describe a factory model's one input
    (:class:`~deeppool.model.loading.ModelSpec`); a model file makes its own inputs.
    """

    model_config = ConfigDict(extra="forbid")

    kind: JobKind
    model: PlainText = Field(min_length=1, max_length=4096, description="a model file's absolute path (under the "
                             "server's allowed roots) or package.module:factory")
    gpus: int = Field(default=1, ge=1, le=4096, description="GPUs for a foreground job; background jobs use 1")
    batch: int = Field(ge=1, le=1 << 24, description="global batch size")
    steps: int = Field(default=100, ge=1, le=10_000_000)
    amplification: float | None = Field(
        default=None, ge=1.0, le=1e6, allow_inf_nan=False, description="the plan's GPU-time amplification cap")
    input_shape: tuple[Annotated[int, Field(ge=1, le=1 << 20)], ...] | None = Field(
        default=None, min_length=1, max_length=8, description="a factory model's per-sample input shape")
    input_dtype: InputDtype | None = Field(default=None, description="a factory model's input dtype (float32 if "
                                           "not given; an integer dtype gives token ids below vocab_size)")
    vocab_size: int | None = Field(default=None, ge=1, le=1 << 31, description="a factory model's token-id range")
    idempotency_key: PlainText | None = Field(default=None, min_length=1, max_length=200,
                                              description="a resubmission with the same key returns the same job")
    script: PlainText | None = Field(default=None, min_length=1, max_length=4096,
                                     description="a foreground job's own training script (an absolute path to a "
                                     ".py under the allowed roots), run on every rank with the plan (it calls "
                                     "deeppool.parallelize)")


class Job(BaseModel):
    """A job as the API returns it."""

    id: int
    kind: JobKind
    state: JobStatus
    owner: str
    model: str
    gpus: int
    batch: int
    steps: int
    amplification: float | None
    input_shape: tuple[int, ...] | None = None
    input_dtype: str | None = None
    vocab_size: int | None = None
    created_at: datetime
    updated_at: datetime
    reason: str | None = None
    exit_code: int | None = None
    progress: float = Field(default=0.0, description="steps done over steps asked, in [0, 1]")
    host_id: int | None = Field(default=None, description="the foreground job whose idle windows it runs in")
    script: str | None = Field(default=None, description="the job's own training script, if it has one")
    width: int | None = Field(default=None, description="the GPUs it runs on, when a resize changed them from gpus")
    run_batch: int | None = Field(default=None, description="its global batch, when the policy changed it")
    run_steps: int | None = Field(default=None, description="the steps its run takes at run_batch (the steps "
                                  "asked are at batch)")
    run_gain: float | None = Field(default=None, description="AdaScale's gain at run_batch: its learning rate is "
                                   "the base one times this, and a step makes this many steps at batch")

    @property
    def held(self) -> int:
        """The GPUs it runs on now."""
        return self.width or self.gpus

    @property
    def current_batch(self) -> int:
        return self.run_batch or self.batch


class WidthChange(BaseModel):
    """One resize of a running job (:mod:`deeppool.coordinator.elastic`): from and to which GPUs and batch, its
    phase, and what each part cost (seconds; None until measured)."""

    id: int
    job_id: int
    from_gpus: int
    to_gpus: int
    from_batch: int
    to_batch: int
    from_steps: int
    """the steps its run took before (to go back to)"""
    from_gain: float
    phase: str
    reason: str
    asked_at: float
    """wall time (Unix seconds) the resize was asked"""
    steps_done: int | None = None
    """the steps its checkpoint holds"""
    checkpoint_s: float | None = None
    stop_s: float | None = None
    plan_s: float | None = None
    plan_cached: bool | None = None
    restart_s: float | None = None
    relaunched_at: float | None = None
    attempt: int | None = None
    """the attempt that runs on the new width"""


class SpeedPoint(BaseModel):
    """A job's measured speed on ``gpus`` at global ``batch``: the median iteration over ``steps`` steps, and
    the last gradient noise scale it reported (samples), when it measures one."""

    job_id: int
    gpus: int
    batch: int
    iteration_s: float
    steps: int
    gns: float | None = None


class JobSpeed(BaseModel):
    """What the coordinator measured of a job (``GET /v1/jobs/{id}/speed``): its speed points, one per (GPUs,
    batch) it ran on, which its speed model is fitted to, and its resizes, oldest first."""

    job_id: int
    points: list[SpeedPoint]
    resizes: list[WidthChange]


class JobEvent(BaseModel):
    id: int
    job_id: int
    from_state: JobStatus | None
    to_state: JobStatus
    reason: str
    at: datetime


def differences(job: Job, request: JobRequest) -> list[str]:
    """How ``request`` asks for another job than ``job``: 'field: X there, Y here' for each field that differs
    (``gpus`` as stored: 1 for a background job)."""
    asked = {**request.model_dump(), "gpus": request.gpus if request.kind is JobKind.FOREGROUND else 1}
    return [f"{name}: {_shown(getattr(job, name))} there, {_shown(asked[name])} here" for name in REQUEST_FIELDS
            if asked[name] != getattr(job, name)]


def _shown(value: object) -> str:
    text = value.value if isinstance(value, enum.Enum) else "null" if value is None else str(value)
    return repr(text if len(text) <= 80 else text[:77] + "...")
