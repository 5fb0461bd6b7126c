"""Calls in flight, by id: how each reply finds its caller, and what a stale one is.

Every wave and RPC gets a fresh call id. A reply whose id is no longer in the
table (its caller timed out, gave up or was failed) is stale and dropped; a
stale :class:`OutputReady` only hands its segment back.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading

from diffusion_runtime.errors import EngineDeadError
from diffusion_runtime.executor.mp.messages import OutputReady, Reply


class RpcCall:
    """A collective RPC: done when each of ``ranks`` replied, or on the first error."""

    def __init__(self, call_id: int, method: str, ranks: tuple[int, ...]) -> None:
        self.call_id = call_id
        self.method = method
        self.ranks = ranks
        self.future: concurrent.futures.Future[dict[int, bytes]] = concurrent.futures.Future()
        self._replies: dict[int, bytes] = {}

    def on_value(self, rank: int, value: bytes) -> None:
        if rank in self.ranks:
            self._replies[rank] = value
            if len(self._replies) == len(self.ranks):
                self.future.set_result(self._replies)


class WaveCall:
    """One wave: done when rank 0 sent both ComputeDone and OutputReady (either order),
    or when any rank reports an error."""

    def __init__(self, call_id: int) -> None:
        self.call_id = call_id
        self.future: concurrent.futures.Future[OutputReady] = concurrent.futures.Future()
        self._compute_done = False
        self._ready: OutputReady | None = None

    def on_compute_done(self) -> None:
        self._compute_done = True
        self._complete()

    def on_output_ready(self, ready: OutputReady) -> None:
        self._ready = ready
        self._complete()

    def _complete(self) -> None:
        if self._compute_done and self._ready is not None:
            self.future.set_result(self._ready)


class CallTable:
    """Thread-safe: callers open and discard calls, the result pump completes them,
    and a failure closes the table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, RpcCall | WaveCall] = {}
        self._closed: str | None = None

    # -- callers -------------------------------------------------------------------------

    def open_rpc(self, method: str, ranks: tuple[int, ...]) -> RpcCall:
        with self._lock:
            call = RpcCall(self._next_id(), method, ranks)
            self._calls[call.call_id] = call
            return call

    def open_wave(self) -> WaveCall:
        with self._lock:
            call = WaveCall(self._next_id())
            self._calls[call.call_id] = call
            return call

    @property
    def closed(self) -> bool:
        """Whether the table refuses new calls (the executor failed or was shut down)."""
        return self._closed is not None

    def discard(self, call_id: int) -> None:
        """Forget a call: from now on its replies are stale."""
        with self._lock:
            self._calls.pop(call_id, None)

    def close(self, reason: str) -> None:
        """Fail every call in flight and every later one with :class:`EngineDeadError`."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            calls = list(self._calls.values())
            self._calls.clear()
        for call in calls:
            if not call.future.done():
                call.future.set_exception(EngineDeadError(reason))

    # -- the result pump -----------------------------------------------------------------

    def on_reply(self, reply: Reply) -> None:
        with self._lock:
            call = self._calls.get(reply.call_id)
            if call is None or call.future.done():
                return
            if reply.error is not None:
                call.future.set_exception(reply.error.rebuild())
            elif isinstance(call, RpcCall):
                call.on_value(reply.rank, reply.value)

    def on_compute_done(self, call_id: int) -> None:
        with self._lock:
            call = self._calls.get(call_id)
            if isinstance(call, WaveCall) and not call.future.done():
                call.on_compute_done()

    def on_output_ready(self, ready: OutputReady) -> bool:
        """Record a wave's output; True when nobody will read its segment (release it now)."""
        with self._lock:
            call = self._calls.get(ready.call_id)
            if not isinstance(call, WaveCall) or call.future.done():
                return True
            call.on_output_ready(ready)
            return False

    def _next_id(self) -> int:
        if self._closed is not None:
            raise EngineDeadError(self._closed)
        return next(self._ids)
