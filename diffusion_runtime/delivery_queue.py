"""DeliveryQueue: outputs wait here, in order, until their tensors are in host memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from diffusion_runtime.contracts import READY, OutputFence

_Item = TypeVar("_Item")


class DeliveryQueue(Generic[_Item]):
    """A FIFO of output batches, each released once its :class:`OutputFence` is ready.

    Outputs leave in the order they were put, so a request's outputs never
    overtake one another: a batch behind one whose copy is still in flight
    waits for it, even if its own fence is ready.
    """

    def __init__(self) -> None:
        self._batches: deque[tuple[OutputFence, list[_Item]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._batches)

    def put(self, items: Iterable[_Item], fence: OutputFence = READY) -> None:
        batch = list(items)
        if batch:
            self._batches.append((fence, batch))

    def take(self, *, wait: bool) -> list[_Item]:
        """The items at the head whose fences are ready; with ``wait``, all of them
        (blocking on each fence in turn). A fence whose copy failed raises."""
        taken: list[_Item] = []
        batches = self._batches
        while batches:
            fence, batch = batches[0]
            if not fence.is_ready():
                if not wait:
                    break
                fence.wait()
            batches.popleft()
            taken.extend(batch)
        return taken

    def discard(self, drop: Callable[[_Item], bool]) -> None:
        """Remove the items ``drop`` selects (their tensors go with them)."""
        if not self._batches:
            return
        batches: deque[tuple[OutputFence, list[_Item]]] = deque()
        for fence, batch in self._batches:
            kept = [item for item in batch if not drop(item)]
            if kept:
                batches.append((fence, kept))
        self._batches = batches

    def clear(self) -> None:
        self._batches.clear()
