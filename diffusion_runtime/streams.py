"""Where a request's outputs go: an asyncio stream or a blocking batch waiter.

The engine loop is the only producer. It pushes outputs and errors; asyncio
consumers are woken once per loop per tick, not once per output.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from diffusion_runtime.errors import EngineClosedError, EngineDeadError
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


async def read_until_final(
    stream: AsyncStream, abandon: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """Yield ``stream``'s outputs until the final one.

    A consumer that stops early (``break``, cancellation) leaves no one to
    read the rest: the stream is closed and ``abandon()`` (an abort) is called.
    A stream that fails with the engine's end raises that error instead.
    """
    finished = False
    try:
        while not finished:
            output = await stream.get()
            finished = output.finished
            yield output
    except (EngineClosedError, EngineDeadError):
        finished = True
        raise
    finally:
        if not finished:
            stream.close()
            abandon()


def claim_stream(unclaimed: dict[str, AsyncStream], request_id: str) -> AsyncStream:
    """Take ``request_id``'s unread stream out of ``unclaimed`` for its one reader.

    Raises ``KeyError`` for an id with no unclaimed stream (unknown, or read
    already) and ``RuntimeError`` when called on another event loop than the
    stream's; the stream then stays unclaimed.
    """
    stream = unclaimed.get(request_id)
    if stream is None:
        raise KeyError(f"no unclaimed output stream for request {request_id!r}")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = stream.loop  # checked when it is read, by asyncio itself
    if running is not stream.loop:
        raise RuntimeError(
            f"request {request_id!r} was added on another event loop; read its stream on that loop"
        )
    del unclaimed[request_id]
    return stream


async def read_stream(
    stream: AsyncStream, abandon: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """:func:`read_until_final`, closed as soon as the reader stops (so an early
    stop aborts now, not when the generator is garbage-collected)."""
    outputs = read_until_final(stream, abandon)
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            yield output


def wake_streams(streams: list[AsyncStream]) -> None:
    for stream in streams:
        stream.wake()


class GenerateWaiter:
    """Collects the final outputs of a blocking ``generate`` call, in prompt order.

    One waiter is the sink of every request of the call (no per-request sink
    objects: at large batch sizes every tracked object costs garbage-collector
    time). The thread that drives the engine pushes; the caller reads
    :attr:`done` and :meth:`result`.
    """

    def __init__(self, request_ids: list[str]) -> None:
        self._index = {request_id: i for i, request_id in enumerate(request_ids)}
        self._outputs: list[RequestOutput | None] = [None] * len(request_ids)
        self._remaining = len(request_ids)
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._remaining == 0 or self._error is not None

    def result(self) -> list[RequestOutput]:
        """The final outputs in prompt order; raises the error the call failed with."""
        if self._error is not None:
            raise self._error
        return [output for output in self._outputs if output is not None]

    def push(self, output: RequestOutput) -> None:
        if output.finished:
            self._outputs[self._index[output.request_id]] = output
            self._remaining -= 1

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error


class FinalOutputFuture:
    """The sink of a call that awaits one final output (the stage's batch request):
    it resolves ``future`` with the output, or fails it with the error; once the
    future is done (or cancelled by its caller), later pushes are dropped."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[RequestOutput]) -> None:
        self.future = future

    def push(self, output: RequestOutput) -> None:
        if output.finished and not self.future.done():
            self.future.set_result(output)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
