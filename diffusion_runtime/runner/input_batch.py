"""InputBatch: the running requests of one denoising step, in scheduler order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

from diffusion_runtime.pipelines.protocols import StepRequestState


class InputBatch(Sequence[StepRequestState]):
    """The states ``denoise_step`` runs over, rebuilt only when the running set changes.

    ``cache`` is for the pipeline: whatever it stacks from per-request
    conditioning (labels, embeddings) can be kept there and reused on every
    step until the set of requests changes, when the cache is cleared. The
    runner calls :meth:`invalidate` whenever it creates or drops a state, since
    an id can come back with a new state (a reused request id).
    """

    def __init__(self) -> None:
        self._ids: tuple[str, ...] = ()
        self._states: list[StepRequestState] = []
        self._valid = False
        self.cache: dict[str, Any] = {}

    def invalidate(self) -> None:
        """Forget the batch: its states and cached stacks go now, not at the next step."""
        self._valid = False
        self._ids = ()
        self._states = []
        self.cache.clear()

    def update(self, request_ids: tuple[str, ...], states: Mapping[str, StepRequestState]) -> bool:
        """Make the batch hold ``request_ids``; True when it had to be rebuilt."""
        if self._valid and request_ids == self._ids:
            return False
        self._valid = True
        self._ids = request_ids
        self._states = [states[rid] for rid in request_ids]
        self.cache.clear()
        return True

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self._ids

    @overload
    def __getitem__(self, index: int) -> StepRequestState: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[StepRequestState]: ...

    def __getitem__(self, index: int | slice) -> StepRequestState | Sequence[StepRequestState]:
        return self._states[index]

    def __len__(self) -> int:
        return len(self._states)
