"""The stage process: a DiffusionEngine served over two ZMQ sockets.

The process connects a PUSH socket to the client's reply endpoint, builds the
engine, binds a PULL socket for requests and says :class:`Ready` (or
:class:`StartFailed`). It then serves until the client sends
:class:`Shutdown` or its process goes away (exit code 0), or the engine dies
(:data:`EXIT_DEAD`) or a signal arrives (``128 + signum``); in the last two
cases it first sends :class:`StageDead`, so the client fails its pending
calls at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing
import os
import random
import signal
import sys
import traceback
from types import FrameType
from typing import Any

import attrs
import zmq
import zmq.asyncio

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    RPCError,
    describe_error,
)
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import MAX_SEED
from diffusion_runtime.stage.allow_list import rpc_allow_list
from diffusion_runtime.stage.batch import merge_batch
from diffusion_runtime.stage.codec import error_to_msg, output_to_frames, params_from_msg
from diffusion_runtime.stage.endpoints import (
    DEFAULT_MAX_REPLY_BYTES,
    bind,
    remove_orphaned_socket_dir,
)
from diffusion_runtime.stage.errors import StageProtocolError
from diffusion_runtime.stage.messages import (
    Abort,
    AddBatchRequest,
    AddRequest,
    Admitted,
    CollectiveRPC,
    FromStage,
    Ready,
    RPCResult,
    Shutdown,
    StageDead,
    StartFailed,
    Status,
    StatusQuery,
    decode_to_stage,
    encode,
    salvage_ids,
)
from diffusion_runtime.stage.security import CurveGuard, CurveIdentity, secure_sockets

logger = logging.getLogger(__name__)

EXIT_START_FAILED = 1
#: The engine died (or the stage's own loop failed); :class:`StageDead` says why.
EXIT_DEAD = 2
#: A signal ends the stage with ``128 + signum``, as a shell reports it.
EXIT_SIGNAL_BASE = 128
#: How often an idle stage checks its engine (a request in flight notices at once).
HEALTH_INTERVAL_S = 0.25
#: How long the last messages (StageDead, StartFailed) may wait for the client.
FINAL_LINGER_MS = 2_000
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@attrs.frozen
class StageSpec:
    """What the stage process is started with (pickled once, by ``spawn``).

    ``reply_endpoint`` is the client's bound PULL socket; ``request_address``
    is where the stage binds its own PULL socket; a request message larger
    than ``max_frame_bytes`` is dropped unread (a frame that large drops its
    sender), and images over ``max_reply_bytes`` are not sent. ``curve`` is
    the stage's CURVE credentials (TCP), None for IPC.
    """

    config: EngineConfig
    reply_endpoint: str
    request_address: str
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    curve: CurveIdentity | None = None


def run_stage(spec: StageSpec) -> None:
    """The process's entry point: serve, then exit with the stage's exit code."""
    for signum in _SIGNALS:
        signal.signal(signum, _exit_on_signal)
    try:
        code = asyncio.run(StageProc(spec).run())
    finally:  # an orphaned stage removes its dead client's socket directory
        remove_orphaned_socket_dir(spec.request_address)
    sys.exit(code)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_SIGNAL_BASE + signum)


class StageProc:
    """Serves one engine to one client. Every task, socket and thread it starts
    ends before :meth:`run` returns."""

    _ctx: zmq.asyncio.Context
    _replies: zmq.asyncio.Socket
    _requests: zmq.asyncio.Socket

    def __init__(self, spec: StageSpec) -> None:
        self._spec = spec
        self._engine: DiffusionEngine | None = None
        self._allowed: frozenset[str] = frozenset()
        self._rpc_pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: Requests and batches by client id, each relayed by one task.
        self._relays: dict[str, asyncio.Task[None]] = {}
        self._batches: dict[str, list[str]] = {}
        #: RPC calls and the streams of half-admitted batches.
        self._background: set[asyncio.Task[Any]] = set()
        self._done: asyncio.Future[int] | None = None
        self._dead_reason: str | None = None
        self._guard: CurveGuard | None = None

    @property
    def engine(self) -> DiffusionEngine:
        assert self._engine is not None, "the engine is built before serving starts"
        return self._engine

    async def run(self) -> int:
        """Start, serve, and return the exit code."""
        self._ctx = zmq.asyncio.Context()
        self._replies = self._ctx.socket(zmq.PUSH)
        self._requests = self._ctx.socket(zmq.PULL)
        try:
            spec = self._spec
            self._guard = secure_sockets(
                self._ctx, self._requests, self._replies, spec.max_frame_bytes, spec.curve
            )
            self._replies.connect(self._spec.reply_endpoint)
            try:
                self._engine = DiffusionEngine.make_engine(self._spec.config)
                self._allowed = rpc_allow_list(self._spec.config)
                endpoint = bind(self._requests, self._spec.request_address)
            except Exception as exc:
                logger.exception("the stage failed to start")
                tb = "".join(traceback.format_exception(exc))
                await self._send(StartFailed(describe_error(exc), tb))
                return EXIT_START_FAILED
            self._rpc_pool = concurrent.futures.ThreadPoolExecutor(1, "diffusion-stage-rpc")
            await self._send(Ready(os.getpid(), endpoint, sorted(self._allowed)))
            return await self._serve()
        finally:
            self._close()

    def _close(self) -> None:
        if self._rpc_pool is not None:
            self._rpc_pool.shutdown(wait=False, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()
        self._requests.close(linger=0)
        self._replies.close(linger=FINAL_LINGER_MS)
        if self._guard is not None:
            self._guard.close()
        self._ctx.term()

    # -- serving -------------------------------------------------------------------------

    async def _serve(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        for signum in _SIGNALS:
            loop.add_signal_handler(signum, self._on_signal, signum)
        parent = multiprocessing.parent_process()
        if parent is not None:
            loop.add_reader(parent.sentinel, self._on_orphaned)
        tasks = [
            asyncio.create_task(self._receive(), name="receive"),
            asyncio.create_task(self._watch_health(), name="health"),
        ]
        for task in tasks:
            task.add_done_callback(self._on_loop_task_end)
        try:
            code = await self._done
        finally:
            for signum in _SIGNALS:
                loop.remove_signal_handler(signum)  # restores the default handler
                signal.signal(signum, _exit_on_signal)
            if parent is not None:
                loop.remove_reader(parent.sentinel)
            everything = [*tasks, *self._relays.values(), *self._background]
            for task in everything:
                task.remove_done_callback(self._on_loop_task_end)
                task.cancel()
            await asyncio.gather(*everything, return_exceptions=True)
        if self._dead_reason is not None:
            await self._send(StageDead(self._dead_reason))
        return code

    def _finish(self, code: int) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(code)

    def _fail(self, reason: str, code: int = EXIT_DEAD) -> None:
        """The stage cannot serve any more: tell the client why, then exit with ``code``."""
        if self._dead_reason is None:
            logger.error("the stage is dead: %s", reason)
            self._dead_reason = reason
        self._finish(code)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self._fail(f"the stage was stopped by {name}", EXIT_SIGNAL_BASE + signum)

    def _on_orphaned(self) -> None:
        logger.warning("the client process is gone; the stage stops")
        self._finish(0)

    def _on_loop_task_end(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(f"the stage's {task.get_name()} loop failed: {task.exception()!r}")

    async def _watch_health(self) -> None:
        """Notice a dead executor while no request is in flight to report it."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                self.engine.check_health()
            except EngineDeadError as exc:
                self._fail(str(exc))
                return

    async def _send(self, message: FromStage, payload: memoryview | None = None) -> None:
        frames = [encode(message)] if payload is None else [encode(message), payload]
        await self._replies.send_multipart(frames, copy=False)

    # -- requests from the client ----------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            frames = await self._requests.recv_multipart(copy=False)
            try:
                await self._handle(frames)
            except Exception:
                logger.exception("handling a client message failed")

    async def _handle(self, frames: list[zmq.Frame]) -> None:
        size = sum(len(frame) for frame in frames)
        if size > self._spec.max_frame_bytes:
            logger.warning("dropped a %d-byte message (limit %d)", size, self._spec.max_frame_bytes)
            return
        header = frames[0].buffer
        try:
            message = decode_to_stage(header)
        except Exception as exc:  # any decode failure: malformed, too deep, too large
            await self._refuse(header, f"unreadable message: {exc}")
            return
        if len(frames) > 1:
            await self._refuse(header, f"a request is one frame; got {len(frames)}")
            return
        if isinstance(message, AddRequest):
            await self._add_request(message)
        elif isinstance(message, AddBatchRequest):
            await self._add_batch(message)
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                self.engine.abort(self._batches.get(request_id, request_id), message.reason)
        elif isinstance(message, CollectiveRPC):
            await self._collective_rpc(message)
        elif isinstance(message, StatusQuery):
            await self._status(message)
        elif isinstance(message, Shutdown):
            self._finish(0)

    async def _refuse(self, header: memoryview, reason: str) -> None:
        request_id, call_id = salvage_ids(header)
        if request_id is None and call_id is None:
            logger.warning("dropped a message: %s", reason)
            return
        await self._send(error_to_msg(StageProtocolError(reason), request_id, call_id))

    async def _reply_error(
        self, exc: Exception, request_id: str | None = None, call_id: int | None = None
    ) -> None:
        await self._send(error_to_msg(exc, request_id, call_id))
        if isinstance(exc, EngineDeadError):
            self._fail(str(exc))

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._relays:
            raise DuplicateRequestError(f"request id {request_id!r} is in use")

    async def _add_request(self, message: AddRequest) -> None:
        request_id = message.request_id
        try:
            self._check_new_id(request_id)
            params = params_from_msg(message.params)
            await self.engine.add_request(message.prompt, params, request_id)
        except Exception as exc:
            await self._reply_error(exc, request_id=request_id)
            return
        await self._send(Admitted(request_id))
        self._relays[request_id] = asyncio.create_task(self._relay(request_id))

    async def _relay(self, request_id: str) -> None:
        """Send each output of one request as it comes."""
        try:
            async for output in self.engine.stream(request_id):
                result, payload = output_to_frames(output, self._spec.max_reply_bytes)
                await self._send(result, payload)
        except EngineDeadError as exc:
            self._fail(str(exc))
        finally:
            self._relays.pop(request_id, None)

    async def _add_batch(self, message: AddBatchRequest) -> None:
        batch_id = message.request_id
        finals: list[asyncio.Task[RequestOutput]] = []
        try:
            self._check_new_id(batch_id)
            if not message.prompts:
                raise InvalidFieldError("AddBatchRequest", "prompts", "must not be empty", [])
            params = params_from_msg(message.params)
            if params.seed is None:  # one seed for the batch, so its output reports it
                params = attrs.evolve(params, seed=random.randint(0, MAX_SEED))
            for index, prompt in enumerate(message.prompts):
                sub_id = _sub_request_id(batch_id, index)
                await self.engine.add_request(prompt, params, sub_id)
                finals.append(asyncio.create_task(self._final_output(sub_id)))
        except Exception as exc:
            if finals:  # abort the prompts admitted so far; their streams drain unseen
                self.engine.abort([_sub_request_id(batch_id, i) for i in range(len(finals))])
                for task in finals:
                    self._keep(task)
            await self._reply_error(exc, request_id=batch_id)
            return
        await self._send(Admitted(batch_id))
        self._batches[batch_id] = [_sub_request_id(batch_id, i) for i in range(len(finals))]
        self._relays[batch_id] = asyncio.create_task(self._relay_batch(batch_id, finals))

    async def _final_output(self, request_id: str) -> RequestOutput:
        last = None
        async for output in self.engine.stream(request_id):
            last = output
        assert last is not None and last.finished
        return last

    async def _relay_batch(self, batch_id: str, finals: list[asyncio.Task[RequestOutput]]) -> None:
        try:
            outputs = await asyncio.gather(*finals)
            result, payload = output_to_frames(
                merge_batch(batch_id, outputs), self._spec.max_reply_bytes
            )
            await self._send(result, payload)
        except EngineDeadError as exc:
            self._fail(str(exc))
        finally:
            for task in finals:
                task.cancel()
            self._relays.pop(batch_id, None)
            self._batches.pop(batch_id, None)

    # -- control ---------------------------------------------------------------------------

    async def _collective_rpc(self, message: CollectiveRPC) -> None:
        if message.method not in self._allowed:
            refusal = RPCError(
                f"method {message.method!r} is not on the stage's RPC allow-list: "
                f"{sorted(self._allowed)}"
            )
            await self._reply_error(refusal, call_id=message.call_id)
            return
        self._keep(asyncio.create_task(self._run_rpc(message)))

    async def _run_rpc(self, message: CollectiveRPC) -> None:
        call = functools.partial(
            self.engine.collective_rpc,
            message.method,
            tuple(message.args),
            message.kwargs,
            message.timeout,
            message.unique_reply_rank,
        )
        try:
            value = await asyncio.get_running_loop().run_in_executor(self._rpc_pool, call)
        except Exception as exc:
            await self._reply_error(exc, call_id=message.call_id)
            return
        try:
            frame = encode(RPCResult(message.call_id, value))
        except TypeError as exc:
            refusal = RPCError(f"the reply of {message.method!r} cannot cross as msgpack: {exc}")
            await self._reply_error(refusal, call_id=message.call_id)
            return
        if len(frame) > self._spec.max_reply_bytes:  # the client would drop this connection
            refusal = RPCError(
                f"the reply of {message.method!r} is {len(frame)} bytes, over the client's "
                f"max_reply_bytes ({self._spec.max_reply_bytes})"
            )
            await self._reply_error(refusal, call_id=message.call_id)
            return
        await self._replies.send(frame)

    async def _status(self, message: StatusQuery) -> None:
        error = None
        try:
            self.engine.check_health()
        except (EngineDeadError, EngineClosedError) as exc:
            error = str(exc)
        await self._send(Status(message.call_id, error is None, error, self.engine.queue_length))
        if error is not None:
            self._fail(error)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a background task until it ends (or the stage cancels it)."""
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("a background task failed: %r", task.exception())


def _sub_request_id(batch_id: str, index: int) -> str:
    return f"{batch_id}/{index}"
