"""The values that cross from scheduling to execution and back.

A :class:`SchedulerOutput` is the whole contract between a scheduling policy
and the executors; a :class:`RunnerOutput` is what a wave produced. Both sit
below the scheduler, the executors and the runner, so none of them imports
another to speak this contract.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch

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


class OutputFence(abc.ABC):
    """Whether a result's tensors have reached host memory: its second phase.

    A wave's result is handed back once its work is enqueued on the device
    (compute done); its ``images`` and ``previews`` are host tensors that may
    still be being written. The fence says when they are complete (output
    ready). On the CPU there is nothing to wait for: the fence is :data:`READY`.
    """

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True once every tensor of the result is in host memory (never blocks)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until :meth:`is_ready`; raise if the copy failed."""


@attrs.frozen
class ReadyFence(OutputFence):
    """The fence of a result whose tensors were complete when it was returned."""

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


#: The fence of every result produced without a device copy in flight.
READY: OutputFence = ReadyFence()


@attrs.define(slots=True)
class WaveCosts:
    """What one wave cost on the worker that returned its results.

    ``seconds`` is the wave's wall time on the worker; ``phases`` maps each
    request the wave ran to the seconds of each phase of its work there
    (``encode``, ``denoise``, ``decode``; a call shared by a batch counts in
    full for each of its requests); ``peak_memory_bytes`` is the worker's
    memory high-water mark during the wave (``None``: not measurable there).
    ``steps`` maps each request to the denoising steps the wave took for it:
    ``(model evaluations, cached steps)`` (a step cache reused the model's
    output instead of running it).
    """

    seconds: float = 0.0
    phases: dict[str, dict[str, float]] = attrs.field(factory=dict)
    peak_memory_bytes: int | None = None
    steps: dict[str, tuple[int, int]] = attrs.field(factory=dict)

    def charge(self, request_ids: Iterable[str], phase: str, seconds: float) -> None:
        """Add ``seconds`` of ``phase`` to each of ``request_ids``."""
        phases = self.phases
        for request_id in request_ids:
            spent = phases.setdefault(request_id, {})
            spent[phase] = spent.get(phase, 0.0) + seconds

    def count_steps(self, request_id: str, evaluations: int, cached: int) -> None:
        """Add steps taken for ``request_id``: ``evaluations`` ran the model, ``cached`` did not."""
        ran, reused = self.steps.get(request_id, (0, 0))
        self.steps[request_id] = (ran + evaluations, reused + cached)


@attrs.frozen(slots=True)
class RunnerOutput:
    """Per-request results of one scheduler output.

    ``images`` maps a request id to its CPU image tensor
    ``(num_outputs, C, H, W)``; ``errors`` maps a request id to why it failed.
    A request id appears in at most one of them; a scheduled id in neither is a
    missing result. In step mode, ``progress`` maps each stepped request to
    ``(step_index, num_steps)`` after the step, ``images`` holds only requests
    that finished their last step, and ``previews`` holds intermediate images.
    ``executed`` lists the ids handed to the pipeline, in order; ``created`` and
    ``released`` the ids whose runner state was created or dropped (the trace
    and the auditor check them against the scheduler's output).
    ``output_ready`` tells when ``images`` and ``previews`` are complete (see
    :class:`OutputFence`); read no tensor of them before it is ready.
    A request that asked for latents (``output_type="latent"``) has them in
    ``images``; one that asked for a trajectory has its stacked latents in
    ``trajectory_latents``, its log-probabilities in ``trajectory_log_probs``
    (when it has any), and its timesteps and the steps those log-probabilities
    belong to in ``trajectory_steps`` (the tensors follow the same fence).
    For a request that streams its trajectory and has steps left, those three
    hold the part recorded since its previous result instead.
    ``costs`` says what the wave cost on its worker (``None`` for a wave that
    never ran there).
    """

    wave_id: int
    images: dict[str, torch.Tensor] = attrs.field(factory=dict)
    errors: dict[str, str] = attrs.field(factory=dict)
    progress: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    previews: dict[str, torch.Tensor] = attrs.field(factory=dict)
    executed: list[str] = attrs.field(factory=list)
    created: list[str] = attrs.field(factory=list)
    released: list[str] = attrs.field(factory=list)
    trajectory_latents: dict[str, torch.Tensor] = attrs.field(factory=dict)
    trajectory_log_probs: dict[str, torch.Tensor] = attrs.field(factory=dict)
    trajectory_steps: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = attrs.field(factory=dict)
    costs: WaveCosts | None = None
    output_ready: OutputFence = READY

    #: The fields that hold tensors (an executor that sends results elsewhere
    #: carries them apart from the rest; see :meth:`tensor_fields`).
    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (
        "images",
        "previews",
        "trajectory_latents",
        "trajectory_log_probs",
    )

    def tensor_fields(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each tensor field's tensors by request id."""
        return {field: getattr(self, field) for field in self.TENSOR_FIELDS}

    def without_tensors(self) -> RunnerOutput:
        """This result with every tensor field emptied."""
        return self.with_tensors({})

    def with_tensors(self, fields: Mapping[str, dict[str, torch.Tensor]]) -> RunnerOutput:
        """This result with the tensor fields in ``fields`` (the others left empty)."""
        changes: dict[str, Any] = {f: dict(fields.get(f, {})) for f in self.TENSOR_FIELDS}
        return attrs.evolve(self, **changes)

    def settled(self) -> RunnerOutput:
        """This result once its tensors are in host memory, with a fence that can cross
        a process boundary (for executors that send results elsewhere)."""
        if self.output_ready is READY:
            return self
        self.output_ready.wait()
        return attrs.evolve(self, output_ready=READY)

    @classmethod
    def failed(cls, wave_id: int, request_ids: tuple[str, ...], message: str) -> RunnerOutput:
        """Every listed request failed with the same message."""
        return cls(wave_id, {}, dict.fromkeys(request_ids, message))
