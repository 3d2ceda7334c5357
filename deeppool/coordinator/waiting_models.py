"""The waiting jobs' speed models and adaptive state, as an elastic policy reads them every tick: each made once,
when the waiting queue reads its job, then kept while the job waits unchanged.

The waiting queue the service keeps between ticks
(:class:`~deeppool.coordinator.waiting.WaitingJobs`) reads a job again after
every event on it that can change what the policy sees of it: a move, and a
change of its shape, progress or measured speeds while it waits (events the
database writes itself: :data:`~deeppool.coordinator.store.WAITING_CHANGES`).
Its resize history cannot change while it waits (a resize begins only on a
running job). So a job's speed model and state are made when the queue reads
it (from its full row, speeds and resizes if it was measured or resized
before; else from the columns the queue reads, shared by the jobs that ask the
same), and kept until the queue reads it again or it leaves: a tick whose
queue did not change costs nothing here, and one after a change reads only the
jobs the change names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from deeppool.coordinator.speeds import LiveSpeed
from deeppool.coordinator.store import WaitingRow
from deeppool.scheduling import Adaptive

Models = tuple[dict[int, LiveSpeed], dict[int, Adaptive]]
"""Speed models and adaptive states by job id (:meth:`Elastic.models <deeppool.coordinator.elastic.Elastic.models>`)."""


class WaitingModels:
    """The waiting jobs' models, kept between ticks (one instance per :class:`~deeppool.coordinator.elastic.Elastic`,
    given to the service's :class:`~deeppool.coordinator.waiting.WaitingJobs`).

    ``models``: the speed models and adaptive states of waiting jobs from the columns the queue reads of them
    (:meth:`Elastic.waiting_models <deeppool.coordinator.elastic.Elastic.waiting_models>`)."""

    def __init__(self, models: Callable[[Sequence[WaitingRow]], Models]) -> None:
        self.models = models
        self._adaptive: dict[int, Adaptive] = {}

    def made(self, rows: Sequence[WaitingRow]) -> Mapping[int, LiveSpeed]:
        """The speed models of the jobs the queue just read; their adaptive states are kept."""
        speeds, adaptive = self.models(rows)
        self._adaptive.update(adaptive)
        return speeds

    def forget(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            self._adaptive.pop(job_id, None)

    @property
    def adaptive(self) -> Mapping[int, Adaptive]:
        """The adaptive states of the waiting jobs that have one (those resized before), by id."""
        return self._adaptive
