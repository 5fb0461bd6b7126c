"""StageClient: the front of an EngineCore that runs in a child process, driven
from asyncio over ZMQ.

The client owns what callers see, once: request ids and seeds (a
:class:`~diffusion_runtime.admission.RequestMinter`), the duplicate-id check,
the validation of sampling params, output streams and batch parents. The
stage process only validates prompts against its pipeline and runs the core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any

import zmq

from diffusion_runtime.admission import RequestMinter
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    RPCError,
)
from diffusion_runtime.executor.mp.spec import portable_config
from diffusion_runtime.executor.rpc_checks import checked_method, checked_timeout
from diffusion_runtime.fsm import Hook, LifecycleEvent, RequestMachine
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.request_groups import (
    RequestGroup,
    check_group_params,
    checked_group_prompts,
    child_request_id,
)
from diffusion_runtime.routes import OutputRoutes
from diffusion_runtime.runner.sleep import checked_sleep_level
from diffusion_runtime.sampling_params import SamplingParams, checked_params, prompts_and_params
from diffusion_runtime.stage.codec import (
    error_from_msg,
    lora_to_msg,
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
    AddRequest,
    AddRequests,
    Admitted,
    CollectiveRPC,
    Error,
    Pause,
    Profile,
    Ready,
    Result,
    Resume,
    RPCResult,
    Sleep,
    StageDead,
    StartFailed,
    Status,
    StatusQuery,
    ToStage,
    WakeUp,
    decode_from_stage,
    encode,
)
from diffusion_runtime.stage.proc import DEFAULT_MAX_FRAME_BYTES
from diffusion_runtime.stage.process import DRAIN_S, StageProcess
from diffusion_runtime.streams import AsyncStream, FinalOutputFuture, OutputSink, read_stream
from diffusion_runtime.validation import bounded_input

logger = logging.getLogger(__name__)


class StageClient:
    """Runs an :class:`~diffusion_runtime.core.EngineCore` in a child process and
    serves the engine's API from asyncio: the same calls, outputs and errors as
    the in-process :class:`~diffusion_runtime.DiffusionEngine`, with every call awaited.

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
        self._minter = RequestMinter()
        self._call_ids = itertools.count()
        #: Where the outputs of each request in the stage go until its final one
        #: (its stream, or its batch's parent), and the streams nobody claimed yet.
        self._routes = OutputRoutes()
        #: Batch parents whose final output is not delivered yet.
        self._batches: dict[str, RequestGroup] = {}
        self._batch_machine: RequestMachine[RequestGroup] = RequestMachine()
        self._batch_machine.add_hook(Hook.TERMINAL, self._abort_children)
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        #: Aborts on their way to the socket (sent from a task, as abort() is sync).
        self._aborts_in_flight: set[asyncio.Future[Any]] = set()
        self._sleeping = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> StageClient:
        """Spawn the stage and wait until its core is ready (see :class:`StageStartError`)."""
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

    @property
    def unfinished_request_ids(self) -> frozenset[str]:
        """Requests sent to the stage whose final output has not reached this client
        (a batch's prompts by their own ids)."""
        return frozenset(self._routes.sinks)

    @property
    def batch_machine(self) -> RequestMachine[RequestGroup]:
        """The lifecycle machine of batch parents: ``batch_machine.subscribe(fn)``
        receives each parent's transitions (their prompts' are in the stage)."""
        return self._batch_machine

    # -- requests --------------------------------------------------------------------------

    async def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Admit one request in the stage and return its id; read it with :meth:`stream`.

        Ids, seeds and params are checked here; the stage checks the prompt
        against its pipeline. Raises what the engine's admission raises
        (``InvalidFieldError``, ``DuplicateRequestError``, ``QueueFullError``).
        The stage answers between two steps of its core.
        """
        request_id = self._minter.request_id(request_id)
        params = checked_params(params)
        bounded_input("request", "prompt", prompt)  # before encoding: no RecursionError
        self._check_free([request_id])
        message = AddRequest(request_id, prompt, params_to_msg(params), self._minter.seed(params))
        stream = AsyncStream(asyncio.get_running_loop(), AsyncStream.wake)
        self._routes.unclaimed[request_id] = stream
        try:
            await self._submit(request_id, message, {request_id: stream})
        except BaseException:
            self._routes.forget([request_id])
            raise
        return request_id

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield a request's outputs until its final one, as ``DiffusionEngine.stream`` does.

        Raises ``KeyError`` at once for an id with no unclaimed stream and
        ``RuntimeError`` on another event loop than the one that added it.
        Stopping early aborts the request; iterating raises
        :class:`EngineDeadError` if the stage dies.
        """
        stream = self._routes.claim(request_id)
        return read_stream(stream, lambda: self._abort_for(request_id, stream))

    async def generate(
        self,
        prompts: list[Any] | tuple[Any, ...] | Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (one request each) and return their final outputs, in order.

        ``params`` is one :class:`SamplingParams` for all or one per prompt. A
        failed request yields an output saying why; admission errors raise
        (after aborting the prompts already admitted). With one params for
        all, the prompts cross in one message and are admitted together (all
        or none), as the in-process ``generate`` admits them.
        """
        prompt_list, params_list = prompts_and_params(prompts, params)
        if len(prompt_list) > 1 and all(p is params_list[0] for p in params_list):
            ids = await self._add_together(prompt_list, params_list[0])
        else:
            ids = await self._add_each(prompt_list, params_list)
        return list(await asyncio.gather(*(self._final_output(rid) for rid in ids)))

    async def _add_together(self, prompts: list[Any], params: SamplingParams | None) -> list[str]:
        """Admit one request per prompt, all with ``params``, in one message."""
        params = checked_params(params)
        ids = [self._minter.request_id() for _ in prompts]
        self._check_free(ids)
        seeds = [self._minter.seed(params) for _ in prompts]
        message = AddRequests(ids[0], ids, prompts, params_to_msg(params), seeds)
        loop = asyncio.get_running_loop()
        streams = {request_id: AsyncStream(loop, AsyncStream.wake) for request_id in ids}
        self._routes.unclaimed.update(streams)
        try:
            await self._submit(ids[0], message, dict(streams))
        except BaseException:
            self._routes.forget(ids)
            raise
        return ids

    async def _add_each(self, prompts: list[Any], params: list[SamplingParams | None]) -> list[str]:
        """Admit one request per prompt, one message each."""
        added = await asyncio.gather(
            *(self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)),
            return_exceptions=True,
        )
        ids = [rid for rid in added if isinstance(rid, str)]
        failure = next((e for e in added if isinstance(e, BaseException)), None)
        if failure is not None:
            self.abort(ids, "generate call failed")
            for request_id in ids:
                self._routes.claim(request_id).close()
            raise failure
        return ids

    async def add_batch_request(
        self,
        prompts: Sequence[Any],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestOutput:
        """Run several prompts as one request and return its one final output.

        Each prompt is a request of its own in the stage (``<request_id>/<index>``),
        all with ``params`` and one seed; the batch is their parent, with a
        lifecycle of its own (see :mod:`diffusion_runtime.request_groups`). It
        completes when every prompt did, with all their images (and latents and
        trajectories, when asked for) in prompt order; the first prompt that
        fails (or is aborted) ends it, with an error naming the prompt's index,
        and aborts the others.
        """
        request_id = self._minter.request_id(request_id)
        params = checked_params(params)
        check_group_params(params)
        prompt_list = checked_group_prompts(prompts)
        child_ids = [child_request_id(request_id, i) for i in range(len(prompt_list))]
        self._check_free([request_id, *child_ids])
        self._open_stage()  # a parent is born only if the stage can take its prompts
        seed = self._minter.seed(params)
        message = AddRequests(
            request_id, child_ids, prompt_list, params_to_msg(params), [seed] * len(child_ids)
        )
        result: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        batch = RequestGroup(
            request_id, child_ids, seed, self._batch_machine, FinalOutputFuture(result)
        )
        self._batches[request_id] = batch
        result.add_done_callback(lambda _: self._batches.pop(request_id, None))
        try:
            await self._submit(request_id, message, dict.fromkeys(child_ids, batch))
        except asyncio.CancelledError:
            batch.abort("the caller stopped waiting for admission")
            result.cancel()
            raise
        except BaseException as exc:
            batch.fail(exc)
            result.exception()  # read: the caller gets ``exc`` from here
            raise
        try:
            return await asyncio.shield(result)
        except asyncio.CancelledError:
            self.abort(request_id, "the caller stopped waiting")
            raise

    def abort(
        self, request_ids: str | Iterable[str], reason: str = "aborted by the caller"
    ) -> None:
        """Abort requests or batch requests in the stage; unknown or finished ids are
        ignored. Aborting a batch aborts each of its prompts."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        others = []
        for request_id in ids:
            batch = self._batches.get(request_id)
            if batch is None:
                others.append(request_id)
            else:  # its terminal hook aborts its prompts
                batch.abort(reason)
        self._send_abort(others, reason)

    def _abort_for(self, request_id: str, stream: AsyncStream) -> None:
        """A reader stopped early: abort the request, unless its id went to another."""
        if self._routes.sink_of(request_id) is stream:
            self._send_abort([request_id], "the consumer stopped reading")

    def _abort_children(self, batch: RequestGroup, event: LifecycleEvent) -> None:
        """The terminal hook of a batch parent: abort the prompts still running."""
        self._send_abort(batch.live_child_ids, event.reason or "its batch ended")

    def _send_abort(self, request_ids: list[str], reason: str) -> None:
        stage = self._stage
        if not request_ids or stage is None or self._closed or self._dead is not None:
            return
        sent = asyncio.ensure_future(stage.requests.send(encode(Abort(request_ids, reason))))
        sent.add_done_callback(_log_send_failure)
        self._aborts_in_flight.add(sent)
        sent.add_done_callback(self._aborts_in_flight.discard)

    # -- control ---------------------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call a worker method on the stage's allow-list (see :attr:`rpc_methods`)
        between two steps of the stage's core; arguments and reply cross as
        msgpack. Refusals and failures raise :class:`RPCError` (or the error the
        method raised); so does a reply that takes more than ``timeout`` seconds,
        waiting for a step included, as in ``DiffusionEngine.collective_rpc``."""
        method = checked_method(method)
        timeout = checked_timeout(timeout)
        call = self._call(
            lambda call_id: CollectiveRPC(
                call_id, method, list(args), kwargs or {}, timeout, unique_reply_rank
            )
        )
        try:
            reply = await asyncio.wait_for(call, timeout)
        except TimeoutError:
            raise RPCError(f"collective_rpc {method!r} timed out after {timeout} s") from None
        if not isinstance(reply, RPCResult):
            raise StageProtocolError(f"the stage answered an RPC with {type(reply).__name__}")
        return reply.value

    # -- adapters (docs/lora.md): run by the stage's core, between two steps -----------

    async def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter on every worker of the stage; False if already loaded."""
        added: bool = await self.collective_rpc("add_lora", [lora_to_msg(request)])
        return added

    async def remove_lora(self, adapter_id: int) -> bool:
        """Unload an adapter; False if not loaded; ``LoRAError`` while a request uses it."""
        removed: bool = await self.collective_rpc("remove_lora", [adapter_id])
        return removed

    async def list_loras(self) -> list[int]:
        """The loaded adapter ids, merged across the stage's workers and sorted."""
        ids: list[int] = await self.collective_rpc("list_loras")
        return ids

    async def pin_lora(self, adapter_id: int) -> bool:
        """Never evict this adapter; False if it is not loaded."""
        pinned: bool = await self.collective_rpc("pin_lora", [adapter_id])
        return pinned

    async def sleep(self, level: int = 1) -> None:
        """Put the stage's engine to sleep once its current wave or step ends (see
        ``EngineCore.sleep`` and ``docs/operations.md``): requests sent meanwhile
        are admitted and wait. Raises what the core raises (``SleepStateError``,
        ``PipelineContractError``)."""
        checked_sleep_level(level)
        await self._operate(lambda call_id: Sleep(call_id, level))
        self._sleeping = True

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed; the stage serves again."""
        await self._operate(WakeUp)
        self._sleeping = False

    @property
    def is_sleeping(self) -> bool:
        """Whether the last :meth:`sleep` or :meth:`wake_up` of this client left the
        stage asleep."""
        return self._sleeping

    async def start_profile(self, prefix: str | None = None) -> list[str]:
        """Start ``torch.profiler`` on every worker of the stage (``profile_dir`` must
        be set in its config); returns the trace paths, by rank."""
        paths: list[str] = await self._operate(lambda call_id: Profile(call_id, True, prefix))
        return paths

    async def stop_profile(self) -> list[str]:
        """Stop profiling and write one trace per worker; returns their paths."""
        paths: list[str] = await self._operate(lambda call_id: Profile(call_id, False))
        return paths

    async def _operate(self, make: Callable[[int], ToStage]) -> Any:
        reply = await self._call(make)
        if not isinstance(reply, RPCResult):
            raise StageProtocolError(f"the stage answered with {type(reply).__name__}")
        return reply.value

    async def pause(self) -> None:
        """Hold the stage's core: once the stage reads this, it starts no wave (or
        step) until :meth:`resume`; requests and aborts sent meanwhile queue up
        (admissions are still answered)."""
        await self._send_in_order(Pause())

    async def resume(self) -> None:
        """End a pause. The stage's next step takes every request and abort sent
        before this returned, aborts included: requests admitted meanwhile share
        its schedule and aborts apply before any wave."""
        await self._send_in_order(Resume())

    async def _send_in_order(self, message: Pause | Resume) -> None:
        """Send ``message`` after every abort sent before it."""
        stage = self._open_stage()
        if self._aborts_in_flight:
            await asyncio.gather(*self._aborts_in_flight, return_exceptions=True)
        await stage.requests.send(encode(message))

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the stage or its executor is dead,
        :class:`EngineClosedError` once the client is shut down."""
        status = await self._status()
        if not status.healthy:
            raise EngineDeadError(status.error or "the stage's executor is not healthy")

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

    def _check_free(self, request_ids: list[str]) -> None:
        """The one duplicate check: an id is taken from admission until its final
        output is read (or, for a batch, delivered)."""
        self._routes.check_free(request_ids)
        for request_id in request_ids:
            if request_id in self._admissions or request_id in self._batches:
                raise DuplicateRequestError(
                    f"request id {request_id!r} is taken: its admission or batch is in flight"
                )

    async def _submit(
        self, request_id: str, message: AddRequest | AddRequests, sinks: dict[str, OutputSink]
    ) -> None:
        """Send an admission and wait for the stage's answer; ``sinks`` take the
        outputs of the requests it admits, by id. A refusal raises its error."""
        stage = self._open_stage()
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
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._admissions[request_id] = admitted
        self._routes.sinks.update(sinks)
        try:
            await stage.requests.send(frame)
            await admitted
        except BaseException as exc:
            for sink_id in sinks:
                self._routes.sinks.pop(sink_id, None)
            self._admissions.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                self._send_abort(list(sinks), "the caller stopped waiting for admission")
            raise

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
            batch = self._batches.get(message.request_id)
            if batch is not None:  # before any of its children's outputs is read
                batch.start()
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
        sink = self._routes.sink_of(result.request_id)
        if sink is None:
            logger.debug("ignored a result for request %r", result.request_id)
            return
        try:
            output = output_from_frames(result, extra)
        except StageProtocolError as exc:
            del self._routes.sinks[result.request_id]  # its stream keeps the error for its reader
            sink.fail(exc)
            return
        self._routes.route(output)
        sink.push(output)

    def _on_error(self, error: Error) -> None:
        future: asyncio.Future[Any] | None = None
        if error.request_id is not None:
            future = self._admissions.pop(error.request_id, None)
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
        for sink in self._routes.close_all():
            sink.fail(error)
        self._admissions.clear()
        self._calls.clear()


def _log_send_failure(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.warning("an abort did not reach the stage: %r", sent.exception())
