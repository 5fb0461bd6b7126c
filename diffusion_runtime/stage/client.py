"""StageClient: a DiffusionEngine in a child process, driven from asyncio over ZMQ."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any

import zmq

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    RPCError,
)
from diffusion_runtime.executor.mp.spec import portable_config
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams, checked_params, prompts_and_params
from diffusion_runtime.stage.codec import (
    error_from_msg,
    output_from_frames,
    params_to_msg,
)
from diffusion_runtime.stage.endpoints import (
    DEFAULT_MAX_REPLY_BYTES,
    LOOPBACK,
    TRANSPORTS,
    checked_frame_limit,
    checked_host,
)
from diffusion_runtime.stage.errors import StageProtocolError
from diffusion_runtime.stage.messages import (
    Abort,
    AddBatchRequest,
    AddRequest,
    Admitted,
    CollectiveRPC,
    Error,
    Ready,
    Result,
    RPCResult,
    StageDead,
    StartFailed,
    Status,
    StatusQuery,
    ToStage,
    decode_from_stage,
    encode,
)
from diffusion_runtime.stage.proc import DEFAULT_MAX_FRAME_BYTES
from diffusion_runtime.stage.process import DRAIN_S, StageProcess
from diffusion_runtime.streams import AsyncStream, read_until_final
from diffusion_runtime.validation import bounded_input

logger = logging.getLogger(__name__)


class StageClient:
    """Runs a :class:`~diffusion_runtime.DiffusionEngine` in a child process and
    serves its API from asyncio: the same calls, outputs and errors as the
    in-process engine, with every call awaited.

    Use it on one event loop, as ``async with StageClient(config) as client:``
    or ``await client.start()`` ... ``await client.shutdown()``. ``transport``
    is ``"ipc"`` (socket files in a private directory) or ``"tcp"`` (ports on
    ``host``, loopback unless asked otherwise; every interface only with
    ``allow_all_interfaces=True``), authenticated both ways with per-launch
    CURVE keys. The stage refuses request frames over ``max_frame_bytes``
    (the client refuses to send one), the client reply frames over
    ``max_reply_bytes``. When the stage dies, every
    pending call fails at once with :class:`EngineDeadError`, and so does
    every later one.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        transport: str = "ipc",
        host: str = LOOPBACK,
        start_timeout_s: float = 300.0,
        shutdown_grace_s: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        allow_all_interfaces: bool = False,
    ) -> None:
        if transport not in TRANSPORTS:
            raise InvalidFieldError(
                "StageClient", "transport", f"must be one of {TRANSPORTS}", transport
            )
        self._config = portable_config(config)
        self._transport = transport
        self._host = checked_host(host, allow_all_interfaces)
        self._start_timeout_s = start_timeout_s
        self._shutdown_grace_s = shutdown_grace_s
        self._max_frame_bytes = checked_frame_limit("max_frame_bytes", max_frame_bytes)
        self._max_reply_bytes = checked_frame_limit("max_reply_bytes", max_reply_bytes)
        self._stage: StageProcess | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        #: Streams of requests whose final output has not arrived, by request id.
        self._live: dict[str, AsyncStream] = {}
        #: Streams nobody has called :meth:`stream` for yet.
        self._unclaimed: dict[str, AsyncStream] = {}
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> StageClient:
        """Spawn the stage and wait until its engine is ready (see :class:`StageStartError`)."""
        if self._stage is not None or self._closed:
            raise RuntimeError("a StageClient starts once")
        self._stage = await StageProcess.launch(
            self._config,
            self._transport,
            self._host,
            self._max_frame_bytes,
            self._max_reply_bytes,
            self._start_timeout_s,
        )
        self._receiver = asyncio.create_task(self._receive(self._stage))
        self._receiver.add_done_callback(self._on_receiver_end)
        return self

    async def shutdown(self) -> None:
        """Stop the stage and release its process, sockets and directory. Idempotent.

        Pending calls fail with :class:`EngineClosedError` (unless the stage died first).
        """
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            self._fail_pending(EngineClosedError("the stage client was shut down"))
        stage, receiver = self._stage, self._receiver
        if receiver is not None:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        if stage is not None:
            await stage.stop(self._shutdown_grace_s)

    async def __aenter__(self) -> StageClient:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    @property
    def pid(self) -> int | None:
        return None if self._stage is None else self._stage.pid

    @property
    def exitcode(self) -> int | None:
        """The stage process's exit code once it has exited (negative: killed by that signal)."""
        return None if self._stage is None else self._stage.exitcode

    @property
    def socket_dir(self) -> str | None:
        """The private directory of the IPC socket files (None for TCP)."""
        stage = self._stage
        return None if stage is None or stage.socket_dir is None else stage.socket_dir.path

    @property
    def rpc_methods(self) -> frozenset[str]:
        """The methods :meth:`collective_rpc` may call, as the stage announced them."""
        stage = self._stage
        return (
            frozenset()
            if stage is None or stage.ready is None
            else frozenset(stage.ready.rpc_methods)
        )

    # -- requests --------------------------------------------------------------------------

    async def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Admit one request in the stage and return its id; read it with :meth:`stream`.

        Raises what the engine's admission raises (``InvalidFieldError``,
        ``DuplicateRequestError``, ``QueueFullError``) once the stage refuses it.
        """
        request_id = self._new_id(request_id)
        bounded_input("request", "prompt", prompt)  # before encoding: no RecursionError
        message = AddRequest(request_id, prompt, params_to_msg(checked_params(params)))
        self._unclaimed[request_id] = await self._submit(request_id, message)
        return request_id

    async def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield a request's outputs until its final one, as the engine's ``stream`` does.

        Stopping early aborts the request; raises :class:`EngineDeadError` if the stage dies.
        """
        stream = self._unclaimed.pop(request_id, None)
        if stream is None:
            raise KeyError(f"no unclaimed output stream for request {request_id!r}")
        outputs = read_until_final(
            stream, lambda: self.abort(request_id, "the consumer stopped reading")
        )
        async with contextlib.aclosing(outputs):  # an early stop aborts now, not at GC
            async for output in outputs:
                yield output

    async def generate(
        self,
        prompts: list[Any] | tuple[Any, ...] | Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (one request each) and return their final outputs, in order.

        ``params`` is one :class:`SamplingParams` for all or one per prompt. A
        failed request yields an output saying why; admission errors raise
        (after aborting the prompts already admitted).
        """
        prompt_list, params_list = prompts_and_params(prompts, params)
        added = await asyncio.gather(
            *(self.add_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)),
            return_exceptions=True,
        )
        ids = [rid for rid in added if isinstance(rid, str)]
        failure = next((e for e in added if isinstance(e, BaseException)), None)
        if failure is not None:
            self.abort(ids, "generate call failed")
            for request_id in ids:
                self._unclaimed.pop(request_id).close()
            raise failure
        return list(await asyncio.gather(*(self._final_output(rid) for rid in ids)))

    async def add_batch_request(
        self,
        prompts: Sequence[Any],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestOutput:
        """Run several prompts as one request and return its one merged final output.

        All prompts share ``params`` and one seed. The output completes only if
        every prompt did, with all their images in prompt order; otherwise it
        has no images, status ``FINISHED_ERROR`` if any prompt failed (else
        ``FINISHED_ABORTED``), and an error naming each such prompt by index.
        """
        request_id = self._new_id(request_id)
        bounded_input("request", "prompts", list(prompts))
        message = AddBatchRequest(request_id, list(prompts), params_to_msg(checked_params(params)))
        stream = await self._submit(request_id, message)
        try:
            return await stream.get()
        except asyncio.CancelledError:
            stream.close()
            self.abort(request_id, "the caller stopped waiting")
            raise

    def abort(
        self, request_ids: str | Iterable[str], reason: str = "aborted by the caller"
    ) -> None:
        """Abort requests (or batch requests) in the stage; unknown or finished ids are ignored."""
        stage = self._stage
        if stage is None or self._closed or self._dead is not None:
            return
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        sent = asyncio.ensure_future(stage.requests.send(encode(Abort(ids, reason))))
        sent.add_done_callback(_log_send_failure)

    # -- control ---------------------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call a worker method on the stage's allow-list (see :attr:`rpc_methods`);
        arguments and reply cross as msgpack. Refusals and failures raise
        :class:`RPCError` (or the error the method raised)."""
        reply = await self._call(
            lambda call_id: CollectiveRPC(
                call_id, method, list(args), kwargs or {}, timeout, unique_reply_rank
            )
        )
        if not isinstance(reply, RPCResult):
            raise StageProtocolError(f"the stage answered an RPC with {type(reply).__name__}")
        return reply.value

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the stage or its engine is dead,
        :class:`EngineClosedError` once the client is shut down."""
        status = await self._status()
        if not status.healthy:
            raise EngineDeadError(status.error or "the stage's engine is not healthy")

    async def queue_length(self) -> int:
        """Requests waiting in the stage's scheduler."""
        return (await self._status()).queue_length

    # -- sending ---------------------------------------------------------------------------

    def _open_stage(self) -> StageProcess:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("the stage client is shut down; it accepts no calls")
        if self._stage is None:
            raise RuntimeError("the StageClient is not started")
        return self._stage

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            return f"{self._id_prefix}-{next(self._ids)}"
        if not isinstance(request_id, str):
            raise InvalidFieldError("request", "request_id", "must be a str", request_id)
        return request_id

    async def _submit(self, request_id: str, message: AddRequest | AddBatchRequest) -> AsyncStream:
        """Send an admission and wait for its answer; the request's output stream."""
        stage = self._open_stage()
        if request_id in self._live or request_id in self._unclaimed:
            raise DuplicateRequestError(
                f"request id {request_id!r} is in use: its final output has not been read yet"
            )
        try:
            frame = encode(message)
        except TypeError as exc:
            field = "prompt" if isinstance(message, AddRequest) else "prompts"
            raise InvalidFieldError(
                "request", field, f"must be msgpack-encodable to reach the stage ({exc})", message
            ) from None
        if len(frame) > self._max_frame_bytes:  # the stage would drop this connection
            field = "prompt" if isinstance(message, AddRequest) else "prompts"
            rule = f"must encode to at most max_frame_bytes ({self._max_frame_bytes}) bytes"
            raise InvalidFieldError("request", field, rule, f"{len(frame)} bytes")
        loop = asyncio.get_running_loop()
        stream = AsyncStream(loop, AsyncStream.wake)
        admitted: asyncio.Future[None] = loop.create_future()
        self._live[request_id] = stream
        self._admissions[request_id] = admitted
        try:
            await stage.requests.send(frame)
            await admitted
        except BaseException as exc:
            self._live.pop(request_id, None)
            self._admissions.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                self.abort(request_id, "the caller stopped waiting for admission")
            raise
        return stream

    async def _final_output(self, request_id: str) -> RequestOutput:
        last = None
        async for output in self.stream(request_id):
            last = output
        assert last is not None
        return last

    async def _call(self, make: Callable[[int], ToStage]) -> Any:
        """Send a message with a fresh call id and return the stage's reply to it."""
        stage = self._open_stage()
        call_id = next(self._call_ids)
        try:
            frame = encode(make(call_id))
        except TypeError as exc:
            raise RPCError(f"the call's arguments cannot cross as msgpack: {exc}") from None
        if len(frame) > self._max_frame_bytes:  # the stage would drop this connection
            raise RPCError(f"the call is {len(frame)} bytes, over max_frame_bytes")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await stage.requests.send(frame)
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def _status(self) -> Status:
        reply = await self._call(StatusQuery)
        if not isinstance(reply, Status):
            raise StageProtocolError(f"the stage answered a status query with {reply!r}")
        return reply

    # -- receiving -------------------------------------------------------------------------

    async def _receive(self, stage: StageProcess) -> None:
        """Route every reply; when the process exits, fail whatever is still pending."""
        receive = asyncio.ensure_future(stage.replies.recv_multipart(copy=False))
        try:
            while True:
                if not receive.done():
                    await asyncio.wait((receive, stage.exited), return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    break
                self._dispatch(receive.result())
                receive = asyncio.ensure_future(stage.replies.recv_multipart(copy=False))
            # Read what the process sent just before it went (its StageDead, say).
            while (await asyncio.wait((receive,), timeout=DRAIN_S))[0]:
                self._dispatch(receive.result())
                receive = asyncio.ensure_future(stage.replies.recv_multipart(copy=False))
            self._die(EngineDeadError(f"the stage process {stage.describe_exit()}"))
        finally:
            receive.cancel()

    def _on_receiver_end(self, receiver: asyncio.Task[None]) -> None:
        if not receiver.cancelled() and receiver.exception() is not None:
            logger.error("the client's receive loop failed", exc_info=receiver.exception())
            self._die(
                EngineDeadError(f"the client's receive loop failed: {receiver.exception()!r}")
            )

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        try:
            message = decode_from_stage(frames[0].buffer)
        except Exception as exc:  # any decode failure: malformed, too deep, too large
            logger.error("dropped an unreadable message from the stage: %r", exc)
            return
        if isinstance(message, Result):
            self._on_result(message, frames[1:])
        elif isinstance(message, Admitted):
            self._resolve(self._admissions.pop(message.request_id, None), None, message)
        elif isinstance(message, (RPCResult, Status)):
            self._resolve(self._calls.pop(message.call_id, None), message, message)
        elif isinstance(message, Error):
            self._on_error(message)
        elif isinstance(message, StageDead):
            self._die(EngineDeadError(f"the stage is dead: {message.reason}"))
        elif isinstance(message, (Ready, StartFailed)):
            logger.warning("ignored a %s from a running stage", type(message).__name__)

    @staticmethod
    def _resolve(future: asyncio.Future[Any] | None, value: Any, message: Any) -> None:
        if future is None:
            logger.debug("ignored a reply nobody waits for: %r", message)
        elif not future.done():
            future.set_result(value)

    def _on_result(self, result: Result, extra: list[zmq.Frame]) -> None:
        stream = self._live.get(result.request_id)
        if stream is None:
            logger.debug("ignored a result for request %r", result.request_id)
            return
        try:
            output = output_from_frames(result, extra)
        except StageProtocolError as exc:
            del self._live[result.request_id]
            stream.fail(exc)
            return
        if output.finished:
            del self._live[result.request_id]
        stream.push(output)

    def _on_error(self, error: Error) -> None:
        future: asyncio.Future[Any] | None = None
        if error.request_id is not None:
            future = self._admissions.pop(error.request_id, None)
            if future is not None:
                self._live.pop(error.request_id, None)
        elif error.call_id is not None:
            future = self._calls.pop(error.call_id, None)
        if future is None:
            logger.warning("the stage refused a message nobody waits for: %s", error.message)
        elif not future.done():
            future.set_exception(error_from_msg(error))

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is None and not self._closed:
            self._dead = error
            self._fail_pending(error)

    def _fail_pending(self, error: Exception) -> None:
        """Fail every admission, call and unfinished stream with ``error``."""
        for future in [*self._admissions.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(error)
        for stream in self._live.values():
            stream.fail(error)
        self._admissions.clear()
        self._calls.clear()
        self._live.clear()


def _log_send_failure(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.warning("an abort did not reach the stage: %r", sent.exception())
