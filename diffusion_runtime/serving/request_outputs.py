"""A streaming request's outputs, read by a task that owns the engine's stream."""

from __future__ import annotations

import asyncio

from diffusion_runtime.front import Front
from diffusion_runtime.outputs import RequestOutput


class RequestOutputs:
    """The outputs of one admitted streaming request, read from the engine by a task of its own.

    The reader starts at admission and reads the engine's stream to the final
    output whatever happens to the HTTP exchange, so the stream is always
    claimed and freed. The consumer (the event stream) reads every output
    with :meth:`next`; :meth:`abandon` aborts the request when nobody wants
    its outputs any more, and the reader then receives the aborted final output.
    """

    def __init__(self, engine: Front, request_id: str, owner: OutputReaders) -> None:
        self.request_id = request_id
        self._read_final = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._owner = owner
        self.reader = asyncio.get_running_loop().create_task(self._read())
        owner.add(self)

    async def _read(self) -> None:
        queue = self._queue
        try:
            async for output in self._engine.stream(self.request_id):
                queue.put_nowait(output)
        except Exception as exc:  # the engine closed or died: the consumer re-raises it
            queue.put_nowait(exc)
        finally:
            self._owner.discard(self)

    @property
    def finished(self) -> bool:
        """Whether the consumer has read the final output (or the engine's end)."""
        return self._read_final

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, or ``None`` if none came within ``timeout`` seconds."""
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, BaseException):
            self._read_final = True
            raise item
        self._read_final = item.finished
        return item

    def abandon(self, reason: str) -> None:
        """Abort the request unless its final output has already been read."""
        if not self.finished:
            self._engine.abort(self.request_id, reason)


class OutputReaders:
    """The reader tasks of one server's streaming requests; :meth:`aclose` ends them all."""

    def __init__(self) -> None:
        self._active: set[RequestOutputs] = set()

    def add(self, outputs: RequestOutputs) -> None:
        self._active.add(outputs)

    def discard(self, outputs: RequestOutputs) -> None:
        self._active.discard(outputs)

    def __len__(self) -> int:
        return len(self._active)

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Abort every unfinished request and give its reader ``grace_s`` seconds to
        see the end (the engine may be paused); then cancel the reader."""
        active = list(self._active)
        for outputs in active:
            outputs.abandon("the server is shutting down")
        readers = [outputs.reader for outputs in active]
        if not readers:
            return
        _, late = await asyncio.wait(readers, timeout=grace_s)
        for reader in late:
            reader.cancel()
        await asyncio.gather(*late, return_exceptions=True)
