"""SchedulerOutput: the whole contract between scheduling policy and execution."""

from __future__ import annotations

from typing import Any

import attrs

from diffusion_runtime.sampling_params import SamplingParams


@attrs.frozen(slots=True)
class NewRequestData:
    """A request's payload, sent to the workers the first time it is scheduled."""

    request_id: str
    prompt: Any
    params: SamplingParams
    seed: int


@attrs.frozen(slots=True)
class SchedulerOutput:
    """What to run in one wave (request mode) or one step (step mode).

    ``scheduled_new_reqs`` carry payloads for requests the workers have not
    seen; ``scheduled_cached_ids`` name requests whose runner state is cached;
    ``finished_ids`` name requests that ended since the previous output, so the
    workers drop anything they hold for them.
    """

    wave_id: int
    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    num_running: int
    num_waiting: int

    @property
    def scheduled_ids(self) -> tuple[str, ...]:
        """Every request to run: those already running (in the order they joined), then new ones."""
        return self.scheduled_cached_ids + tuple(r.request_id for r in self.scheduled_new_reqs)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduled_new_reqs or self.scheduled_cached_ids)
