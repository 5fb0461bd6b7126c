"""Device copies the harness holds in flight, so the two-phase output path runs on the CPU.

On the CPU every wave's fence is ready at once: a core that delivered an output
before its copy landed, or dropped copies still in flight, would pass any test.
:class:`CopiesInFlight` wraps an executor's ``execute``: while
:attr:`~CopiesInFlight.hold` is set, each result with tensors (images, previews,
latents, trajectories) gets a
:class:`HeldCopy` fence, and its tensors read NaN (as a copy still being written
would) until the copy completes: when the harness lands it, or when the core
waits on its fence (as a real device copy would complete under ``wait``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from diffusion_runtime.contracts import READY, OutputFence, RunnerOutput, SchedulerOutput


class HeldCopy(OutputFence):
    """The fence of one wave's tensors: NaN until :meth:`complete` writes them back."""

    def __init__(
        self, tensors: list[torch.Tensor], progress_ids: frozenset[str], on_wait: Callable[[], None]
    ) -> None:
        #: The requests whose progress outputs wait on this copy.
        self.progress_ids = progress_ids
        self._tensors = tensors
        self._values = [tensor.clone() for tensor in tensors]
        self._on_wait = on_wait
        with torch.inference_mode():  # the runner's tensors may be inference tensors
            for tensor in tensors:
                tensor.fill_(float("nan"))

    @property
    def landed(self) -> bool:
        return not self._values

    def is_ready(self) -> bool:
        return self.landed

    def wait(self) -> None:
        if not self.landed:
            self._on_wait()
            self.complete()

    def complete(self) -> None:
        """Land the copy: the tensors hold their values from now on."""
        with torch.inference_mode():
            for tensor, value in zip(self._tensors, self._values, strict=True):
                tensor.copy_(value)
        self._values = []

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares memory with a tensor of this copy."""
        pointer = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == pointer for t in self._tensors)


@attrs.define
class CopiesInFlight:
    """Holds the copies of the results ``execute`` returns while :attr:`hold` is set."""

    execute: Callable[[SchedulerOutput], RunnerOutput]
    hold: bool = False
    #: How many held copies the core waited on (each landed when it did).
    waited: int = 0
    _copies: list[HeldCopy] = attrs.field(factory=list)

    def __call__(self, output: SchedulerOutput) -> RunnerOutput:
        result = self.execute(output)
        tensors = [t for by_id in result.tensor_fields().values() for t in by_id.values()]
        if not (self.hold and tensors and result.output_ready is READY):
            return result
        copy = HeldCopy(tensors, frozenset(result.progress), self._count_wait)
        self._copies.append(copy)
        return attrs.evolve(result, output_ready=copy)

    def _count_wait(self) -> None:
        self.waited += 1

    @property
    def in_flight(self) -> list[HeldCopy]:
        """The copies that have not landed yet, oldest first."""
        self._copies = [copy for copy in self._copies if not copy.landed]
        return list(self._copies)

    def complete(self, count: int) -> int:
        """Land the oldest ``count`` copies still in flight; how many landed."""
        landing = self.in_flight[:count]
        for copy in landing:
            copy.complete()
        return len(landing)

    def carries(self, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` belongs to a copy still in flight."""
        return tensor is not None and any(copy.holds(tensor) for copy in self.in_flight)

    def carries_progress_of(self, request_id: str) -> bool:
        """Whether a copy still in flight carries progress of ``request_id``."""
        return any(request_id in copy.progress_ids for copy in self.in_flight)
