"""Where a request's outputs go: an asyncio stream or a blocking batch waiter.

The engine loop is the only producer. It pushes outputs and errors; asyncio
consumers are woken once per loop per tick, not once per output.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from diffusion_runtime.outputs import RequestOutput


class OutputSink(Protocol):
    """A consumer of one request's outputs, fed by the engine loop."""

    def push(self, output: RequestOutput) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class AsyncStream:
    """One request's outputs for a consumer on an asyncio event loop."""

    __slots__ = ("_error", "_items", "_notify", "_waiter", "closed", "loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, notify: Callable[[AsyncStream], None]
    ) -> None:
        self.loop = loop
        self.closed = False
        self._notify = notify
        self._items: deque[RequestOutput] = deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- producer side (engine loop thread) ------------------------------------------

    def push(self, output: RequestOutput) -> None:
        if not self.closed:
            self._items.append(output)
            self._notify(self)

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self._error = error
            self._notify(self)

    # -- consumer side (its event loop) --------------------------------------------------

    async def get(self) -> RequestOutput:
        """The next output; raises the error the stream failed with."""
        while True:
            if self._items:
                return self._items.popleft()
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            # Re-check: a push may have landed before the waiter existed.
            if not self._items and self._error is None:
                await self._waiter
            self._waiter = None

    def wake(self) -> None:
        """Runs on the consumer's loop."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """The consumer is gone: drop what is queued and ignore later pushes."""
        self.closed = True
        self._items.clear()


def wake_streams(streams: list[AsyncStream]) -> None:
    for stream in streams:
        stream.wake()


class GenerateWaiter:
    """Collects the final outputs of a blocking ``generate`` call, in prompt order."""

    def __init__(self, count: int) -> None:
        self.outputs: list[RequestOutput | None] = [None] * count
        self.error: BaseException | None = None
        self._remaining = count
        self._done = threading.Event()
        if count == 0:
            self._done.set()

    def slot(self, index: int) -> _WaiterSlot:
        return _WaiterSlot(self, index)

    def wait(self, timeout: float | None = None) -> list[RequestOutput]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"generate did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return [output for output in self.outputs if output is not None]

    def _deliver(self, index: int, output: RequestOutput) -> None:
        if output.finished:
            self.outputs[index] = output
            self._remaining -= 1
            if self._remaining == 0:
                self._done.set()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._done.set()


class _WaiterSlot:
    __slots__ = ("index", "waiter")

    def __init__(self, waiter: GenerateWaiter, index: int) -> None:
        self.waiter = waiter
        self.index = index

    def push(self, output: RequestOutput) -> None:
        self.waiter._deliver(self.index, output)

    def fail(self, error: BaseException) -> None:
        self.waiter._fail(error)
