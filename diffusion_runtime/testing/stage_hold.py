"""Holding a stage's loop between two steps, as ``DiffusionEngine.pause()`` holds its
loop: a test tool, so that requests and aborts sent meanwhile pile up and are
read together once the hold ends.

The stage serves RPCs between two steps of its core, on its only thread. The
worker extension :class:`StageHold` (added to the stage's config by the
harness, never by the runtime) answers ``hold_until_released`` only once the
holder lets go, and meanwhile the stage reads no message and runs no step.
Holder and stage meet on a FIFO: the stage opens it to read, the holder opens
it to write (which succeeds only once the stage is inside the hold) and
closes it to release the stage.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import tempfile
import time
from typing import Any

from diffusion_runtime.stage import StageClient

#: The RPC method the extension adds to the stage's allow-list.
HOLD_METHOD = "hold_until_released"
#: How often the holder checks whether the stage has reached the hold.
HOLD_POLL_S = 0.001


class StageHold:
    """A worker extension whose RPC blocks until the holder closes the FIFO."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def hold_until_released(self, fifo: str) -> None:
        descriptor = os.open(fifo, os.O_RDONLY)  # returns once the holder has it open
        try:
            os.read(descriptor, 1)  # end of file: the holder closed its end
        finally:
            os.close(descriptor)


class StageHolder:
    """The holder's side: :meth:`hold` returns once the stage is held, :meth:`release`
    once it answered. Owns the FIFO's directory; :meth:`close` removes it."""

    def __init__(self, client: StageClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop
        self._dir = tempfile.mkdtemp(prefix="diffusion-stage-hold-")
        self._fifo = os.path.join(self._dir, "hold")
        os.mkfifo(self._fifo, 0o600)
        self._call: asyncio.Task[Any] | None = None
        self._descriptor: int | None = None

    @property
    def held(self) -> bool:
        return self._call is not None

    def hold(self, timeout: float) -> None:
        """Send the hold and wait until the stage is inside it (so every message
        sent from now on waits for :meth:`release`)."""
        assert self._call is None, "the stage is held already"
        call = self._client.collective_rpc(HOLD_METHOD, [self._fifo], unique_reply_rank=0)
        self._call = self._loop.create_task(call)
        deadline = time.monotonic() + timeout
        while self._descriptor is None:
            self._loop.run_until_complete(asyncio.sleep(HOLD_POLL_S))  # the call goes out
            try:
                self._descriptor = os.open(self._fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                if self._call.done():
                    self._call.result()  # raises what ended the call
                assert time.monotonic() < deadline, f"the stage was not held within {timeout} s"

    def release(self, timeout: float) -> None:
        """Let the stage go on and wait for its answer to the hold."""
        call, descriptor = self._call, self._descriptor
        self._call, self._descriptor = None, None
        if descriptor is not None:
            os.close(descriptor)
        if call is not None:
            self._loop.run_until_complete(asyncio.wait_for(call, timeout))

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None
        shutil.rmtree(self._dir, ignore_errors=True)
