"""DiffusionEngine: admission, the control loop, output streams, RPC and close.

One background thread runs the loop; each tick is

1. run control work callers queued (collective RPCs, snapshots), then aborts;
2. ``scheduler.schedule()`` picks a wave and returns a ``SchedulerOutput``;
3. ``executor.execute(output)`` runs it on the workers;
4. aborts that arrived meanwhile are applied, then
   ``scheduler.update_from_output()`` commits the results, and the machine's
   terminal hooks deliver each final output to its stream.

Callers on any thread add requests (under a lock shared with steps 2 and 4)
and queue aborts and RPCs; only the loop thread fires transitions while the
engine is open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    RPCError,
    describe_error,
)
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.executor.selection import resolve_executor_class
from diffusion_runtime.fsm import Hook, LifecycleEvent, RequestMachine, RequestStatus, Trigger
from diffusion_runtime.fsm.audit import Auditor, InvariantViolation, Violation
from diffusion_runtime.fsm.events import DeliveryEvent, EngineEvent, RunnerEvent, WaveEvent
from diffusion_runtime.fsm.trace import JsonlTraceWriter
from diffusion_runtime.outputs import RequestMetrics, RequestOutput
from diffusion_runtime.runner.worker import Worker
from diffusion_runtime.sampling_params import (
    MAX_SEED,
    SamplingParams,
    checked_params,
    prompts_and_params,
)
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.scheduler.step_scheduler import StepScheduler
from diffusion_runtime.streams import (
    AsyncStream,
    GenerateWaiter,
    OutputSink,
    read_until_final,
    wake_streams,
)

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LENGTH = 256
# Admission of a large batch takes the scheduler lock in chunks so the loop can run between them.
_ADMISSION_CHUNK = 512


@attrs.frozen
class EngineSnapshot:
    """What the engine and its workers hold right now, by request id (for checks and audits)."""

    scheduler_ids: frozenset[str]
    running_ids: frozenset[str]
    waiting: int
    runner_cached_ids: frozenset[str]
    executor_held_ids: frozenset[str]
    unclaimed_stream_ids: frozenset[str]


@attrs.define
class _ControlCall:
    """Work a caller asked the loop to run between ticks."""

    future: concurrent.futures.Future[Any]
    fn: Callable[[], Any]


class DiffusionEngine:
    """Serves diffusion requests: admits them, runs them in waves, streams their outputs.

    Build one with :meth:`make_engine` (which also warms the model up) and close
    it with :meth:`close` or a ``with`` block.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        scheduler_cls: type[BaseScheduler] | None = None,
        executor: DiffusionExecutor | None = None,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig; got {type(config).__name__}")
        self.config = config
        self.machine: RequestMachine[Request] = RequestMachine()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._aborts: deque[tuple[Request, str]] = deque()
        self._control: deque[_ControlCall] = deque()
        self._streams: dict[str, AsyncStream] = {}
        self._pending_wakes: dict[asyncio.AbstractEventLoop, list[AsyncStream]] = {}
        self._closed = False
        self._paused = False
        self._lock_owner: int | None = None
        self._close_lock = threading.Lock()
        self._fatal: EngineDeadError | None = None
        self._id_prefix = secrets.token_hex(4)
        self._id_counter = itertools.count()
        self._seeds = random.Random(secrets.randbits(64))
        self._last_batch_key: tuple[SamplingParams | None, Hashable] = (None, None)
        self._trace_writer: JsonlTraceWriter | None = None
        self._traced_waves: set[int] = set()
        self.auditor: Auditor | None = None
        self._executor = (
            executor if executor is not None else resolve_executor_class(config)(config)
        )
        try:
            self._start_trace()
            if scheduler_cls is None:
                step_mode = config.resolved_mode == "step"
                scheduler_cls = StepScheduler if step_mode else RequestScheduler
            if scheduler_cls.execution_mode != config.resolved_mode:
                raise ValueError(
                    f"{scheduler_cls.__name__} schedules {scheduler_cls.execution_mode} mode, "
                    f"but the engine runs in {config.resolved_mode} mode"
                )
            self.scheduler = scheduler_cls(self.machine, config)
            self.machine.add_hook(Hook.TERMINAL, self._deliver_final)
            self.machine.add_hook(Hook.TERMINAL, self._release_executor_bookkeeping)
            self._executor.add_failure_callback(lambda reason: self._wakeup.set())
            self._thread = threading.Thread(
                target=self._run_loop, name="diffusion-engine-loop", daemon=True
            )
            self._thread.start()
        except BaseException:
            self._executor.shutdown()
            self._end_trace(EngineEvent("dead", time.monotonic(), "start-up failed"))
            raise

    @classmethod
    def make_engine(cls, config: EngineConfig, **kwargs: Any) -> DiffusionEngine:
        """Build an engine and run one warm-up request; close everything if either fails."""
        engine = cls(config, **kwargs)
        try:
            if config.warmup:
                engine._warm_up()
        except BaseException:
            engine.close()
            raise
        return engine

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[Any] | tuple[Any, ...] | Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion and return one final output per prompt, in order.

        ``prompts`` is a list or tuple of prompts; anything else is one prompt.
        ``params`` is one :class:`SamplingParams` for all prompts or one per
        prompt. A request that fails or is aborted yields an output saying why.
        The call raises for bad input (before anything is admitted), a full
        queue, ``timeout`` expiry, and the engine closing or dying meanwhile.
        """
        prompt_list, params_list = prompts_and_params(prompts, params)
        waiter = GenerateWaiter()
        requests = [
            self._new_request(prompt, p, None, waiter)
            for prompt, p in zip(prompt_list, params_list, strict=True)
        ]
        for request in requests:
            waiter.expect(request.request_id)
        for start in range(0, len(requests), _ADMISSION_CHUNK):
            try:
                self._admit(requests[start : start + _ADMISSION_CHUNK])
            except BaseException:
                self.abort([r.request_id for r in requests[:start]], "generate call failed")
                raise
        try:
            return waiter.wait(timeout)
        except BaseException:
            self.abort([r.request_id for r in requests], "generate call was interrupted")
            raise

    async def add_request(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Admit one request and return its id; read its outputs with :meth:`stream`.

        Outputs are held for the caller until :meth:`stream` reads them, even
        when the request is aborted or finishes first.
        """
        stream = AsyncStream(asyncio.get_running_loop(), self._note_wake)
        request = self._new_request(prompt, params, request_id, stream)
        self._admit([request], stream=stream)
        return request.request_id

    async def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield a request's outputs until its final one.

        Raises :class:`EngineClosedError` or :class:`EngineDeadError` if the
        engine ends first. Stopping early (``break``, cancellation) aborts the
        request: nobody is left to read its result.
        """
        stream = self._streams.pop(request_id, None)
        if stream is None:
            raise KeyError(f"no unclaimed output stream for request {request_id!r}")
        outputs = read_until_final(
            stream, lambda: self.abort(request_id, "the consumer stopped reading")
        )
        async with contextlib.aclosing(outputs):  # an early stop aborts now, not at GC
            async for output in outputs:
                yield output

    def abort(
        self, request_ids: str | Iterable[str], reason: str = "aborted by the caller"
    ) -> None:
        """Abort requests at the next tick. Ids unknown or finished at the time of
        the call are ignored (a later request that reuses the id is not aborted).

        An aborted request's stream still ends with its final output (aborted,
        or completed if the request won the race).
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:  # resolve now: a later request reusing an id is not the target
            targets = [self.scheduler.get_request(rid) for rid in ids]
        self._aborts.extend((r, reason) for r in targets if r is not None)
        self._wakeup.set()

    # -- control -------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call a worker method between ticks (so it never races a wave); see
        :meth:`DiffusionExecutor.collective_rpc`. The methods that run scheduler
        outputs are not callable here: only the scheduler decides what runs."""
        if method in Worker.EXECUTION_METHODS:
            raise RPCError(f"method {method!r} is reserved for the executor")
        try:
            return self._between_ticks(
                lambda: self._executor.collective_rpc(
                    method, args, kwargs or {}, timeout, unique_reply_rank
                ),
                timeout,
            )
        except concurrent.futures.TimeoutError:
            raise RPCError(f"collective_rpc {method!r} timed out after {timeout} s") from None

    def pause(self) -> None:
        """Stop starting waves (or steps) after the current one; requests and
        aborts queue up, while RPCs and snapshots still run. For maintenance,
        and for tests that need requests to pile up."""
        self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`: queued aborts apply, then scheduling continues."""
        self._paused = False
        self._wakeup.set()

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the executor or the loop has failed,
        :class:`EngineClosedError` once the engine is closed."""
        self._check_open()
        self._executor.check_health()

    @property
    def queue_length(self) -> int:
        return self.scheduler.num_waiting

    @property
    def is_closed(self) -> bool:
        return self._closed

    def snapshot(self) -> EngineSnapshot:
        """Per-request state held by the scheduler, the runner and the engine's streams,
        taken between two ticks (so all parts agree) while the engine runs."""

        def take(cached: list[str]) -> EngineSnapshot:
            with self._lock:
                return EngineSnapshot(
                    scheduler_ids=frozenset(self.scheduler.requests),
                    running_ids=frozenset(self.scheduler.running),
                    waiting=self.scheduler.num_waiting,
                    runner_cached_ids=frozenset(cached),
                    executor_held_ids=self._executor.held_request_ids(),
                    unclaimed_stream_ids=frozenset(self._streams),
                )

        self._refuse_reentry("snapshot()")
        if self._closed or self._fatal is not None:
            return take([])
        snapshot: EngineSnapshot = self._between_ticks(
            lambda: take(self._executor.collective_rpc("cached_request_ids", unique_reply_rank=0))
        )
        return snapshot

    def close(self) -> None:
        """Stop the loop, end every open stream with :class:`EngineClosedError`,
        and shut the executor down. Idempotent; must not be called from a hook."""
        with self._close_lock:
            if self._closed:
                return
            if threading.current_thread() is self._thread:
                raise RuntimeError("close() cannot be called from the engine loop")
            with self._lock:
                self._closed = True
            self._wakeup.set()
            self._thread.join()
            # Whatever fails on the way, the executor is shut down and the trace closed.
            try:
                self._end_all(EngineClosedError("the engine was closed"), Trigger.ABORT)
                self._release_everything_on_workers()
            finally:
                self._executor.shutdown()
                if self._fatal is None:
                    self._end_trace(EngineEvent("closed", time.monotonic()))

    def _release_everything_on_workers(self) -> None:
        """Let the workers drop the state of requests ended by close (best effort)."""
        if self._fatal is not None or self._executor.is_failed:
            return
        with self._lock:
            release = self._trace_wave(self.scheduler.schedule_release())
        if release is not None:
            try:
                self._release_on_workers(release)
            except EngineDeadError:
                logger.warning("the executor died while closing")

    def _start_trace(self) -> None:
        config = self.config
        if config.trace_path is not None:
            self._trace_writer = JsonlTraceWriter(config.trace_path)
            self.machine.subscribe(self._trace_writer)
        if config.audit != "off":
            self.auditor = Auditor(on_violation=self._on_violation)
            self.machine.subscribe(self.auditor.feed)
        if self.machine.traced:
            self.machine.publish(EngineEvent("started", time.monotonic()))

    def _on_violation(self, violation: Violation) -> None:
        logger.error("invariant violated: %s", violation.describe())
        if self.config.audit == "raise":
            raise InvariantViolation(violation)

    def _end_trace(self, event: EngineEvent) -> None:
        """Publish the engine's last event, run the auditor's end checks, close the trace."""
        with self._lock:
            if self.machine.traced:
                self.machine.publish(event)
            if self.auditor is not None:
                try:
                    self.auditor.finish()
                except InvariantViolation:
                    logger.error("the engine ended with invariant violations")
            if self._trace_writer is not None:
                self._trace_writer.close()

    def _between_ticks(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the loop thread between two ticks and return its result."""
        self._refuse_reentry("this call")
        call = _ControlCall(concurrent.futures.Future(), fn)
        with self._lock:  # close and death drain the queue under this lock
            self._check_open()
            self._control.append(call)
        self._wakeup.set()
        try:
            return call.future.result(timeout)
        except concurrent.futures.TimeoutError:
            call.future.cancel()
            raise

    # -- admission -----------------------------------------------------------------------

    def _new_request(
        self, prompt: Any, params: SamplingParams | None, request_id: str | None, sink: OutputSink
    ) -> Request:
        self._check_open()
        params = checked_params(params)
        if request_id is None:
            request_id = f"{self._id_prefix}-{next(self._id_counter)}"
        elif not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH:
            raise InvalidFieldError(
                "request",
                "request_id",
                f"must be a non-empty str of at most {MAX_REQUEST_ID_LENGTH} characters",
                request_id,
            )
        self._executor.validate_request(prompt, params)
        seed = params.seed if params.seed is not None else self._seeds.randint(0, MAX_SEED)
        # One params object is often shared by many prompts: compute its key once.
        cached_params, batch_key = self._last_batch_key
        if params is not cached_params:
            batch_key = self.scheduler.batch_key_for(params)
            self._last_batch_key = (params, batch_key)
        return Request(request_id, prompt, params, seed, batch_key, sink)

    def _admit(self, requests: list[Request], stream: AsyncStream | None = None) -> None:
        """Admit all of ``requests`` or none of them; register ``stream`` for a single one.

        The id check and the stream's registration happen under one lock, so
        two callers can never both claim one id.
        """
        self._refuse_reentry("admission")
        with self._lock:
            self._lock_owner = threading.get_ident()  # admitted hooks run under the lock
            try:
                self._check_open()
                if stream is not None:
                    [request] = requests
                    if request.request_id in self._streams:
                        raise DuplicateRequestError(
                            f"request id {request.request_id!r} is taken: "
                            "its output has not been read yet"
                        )
                admitted = 0
                try:
                    for request in requests:
                        self.scheduler.add_request(request)
                        admitted += 1
                except BaseException:
                    for request in requests[:admitted]:
                        request.sink = None
                        self.scheduler.abort_request(request.request_id, "admission failed")
                    raise
                if stream is not None:
                    # Outputs that come before a reader wait in the stream object.
                    self._streams[requests[0].request_id] = stream
            finally:
                self._lock_owner = None
        self._wakeup.set()

    def _refuse_reentry(self, what: str) -> None:
        """Hooks run on the loop thread or under the admission lock: calling back
        into the engine from there would deadlock, so it is an error."""
        if threading.current_thread() is self._thread or self._lock_owner == threading.get_ident():
            raise RuntimeError(f"{what} cannot be made from a lifecycle hook or the engine loop")

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise EngineClosedError("the engine is closed; it accepts no requests")

    def _warm_up(self) -> None:
        warmup = self.collective_rpc("warmup_request", unique_reply_rank=0)
        if warmup is None:
            return
        prompt, params = warmup
        [output] = self.generate([prompt], params)
        if not output.ok:
            raise RuntimeError(f"the warm-up request failed: {output.error}")

    # -- the loop ------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while self._tick():
                pass
        except BaseException as exc:
            if isinstance(exc, EngineDeadError):
                error = exc
            else:
                logger.exception("the engine loop crashed")
                error = EngineDeadError(f"the engine loop crashed: {describe_error(exc)}")
                error.__cause__ = exc
            self._fatal = error
            try:
                self._end_all(error, Trigger.FAIL)
            except Exception:  # the loop is ending: report, never escape the thread
                logger.exception("a hook failed while the engine's requests were failed")
            finally:
                self._end_trace(EngineEvent("dead", time.monotonic(), str(error)))

    def _tick(self) -> bool:
        """One pass of the control loop; False once the engine is closing."""
        self._wakeup.clear()
        self._executor.check_health()
        while self._control:
            self._run_control(self._control.popleft())
        with self._lock:
            if self._closed:
                return False
            output = None
            if not self._paused:
                self._apply_aborts()
                output = self._trace_wave(self.scheduler.schedule(time.monotonic()))
        if output is None:
            self._flush_wakes()
            wake_at = None if self._paused else self.scheduler.next_wakeup()
            self._wakeup.wait(None if wake_at is None else max(0.0, wake_at - time.monotonic()))
            return True
        self._flush_wakes()  # outputs of requests aborted before the wave need not wait for it
        result = self._execute(output)
        with self._lock:
            self._trace_runner(result)
            aborted_running = self._apply_aborts()
            self.scheduler.update_from_output(output, result)
            if self.config.streaming_output:
                self._deliver_progress(result)
            # The workers may still hold state for requests aborted during this
            # wave: release it now rather than with a future wave.
            release = (
                self._trace_wave(self.scheduler.schedule_release()) if aborted_running else None
            )
        if release is not None:
            self._release_on_workers(release)
        self._flush_wakes()
        return True

    def _execute(self, output: SchedulerOutput) -> RunnerOutput:
        try:
            return self._executor.execute(output)
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.exception("executor failed on wave %d", output.wave_id)
            with self._lock:  # the workers may not have seen them: tell them again next time
                self.scheduler.requeue_finished_ids(output.finished_ids)
            return RunnerOutput.failed(output.wave_id, output.scheduled_ids, describe_error(exc))

    def _release_on_workers(self, release: SchedulerOutput) -> None:
        result = self._execute(release)
        with self._lock:
            self._trace_runner(result)

    # -- tracing -----------------------------------------------------------------------

    def _trace_wave(self, output: SchedulerOutput | None) -> SchedulerOutput | None:
        if output is not None and self.machine.traced:
            # A wave's runner event is published only if its wave event was: a
            # subscriber that joins mid-wave never sees a result without its wave.
            self._traced_waves.add(output.wave_id)
            self.machine.publish(
                WaveEvent(
                    output.wave_id,
                    tuple(r.request_id for r in output.scheduled_new_reqs),
                    output.scheduled_cached_ids,
                    output.finished_ids,
                    time.monotonic(),
                )
            )
        return output

    def _trace_runner(self, result: RunnerOutput) -> None:
        if result.wave_id in self._traced_waves:
            self._traced_waves.discard(result.wave_id)
            self.machine.publish(
                RunnerEvent(
                    result.wave_id,
                    tuple(result.executed),
                    tuple(result.images),
                    tuple(result.progress),
                    tuple(result.errors),
                    tuple(result.created),
                    tuple(result.released),
                    time.monotonic(),
                )
            )

    def _trace_delivery(
        self, request: Request, output: RequestOutput | None, status: RequestStatus
    ) -> None:
        """Publish a delivery (``output``) or a drop (``None``) of one of ``request``'s outputs."""
        images = None if output is None else output.image_batch
        self.machine.publish(
            DeliveryEvent(
                request.request_id,
                status,
                finished=output is None or output.finished,
                dropped=output is None,
                digest="" if images is None else _digest(images),
                fingerprint=_fingerprint(request),
                time=time.monotonic(),
            )
        )

    def _apply_aborts(self) -> bool:
        """Apply queued aborts; True if any of them ended a running request."""
        aborted_running = False
        while self._aborts:
            request, reason = self._aborts.popleft()
            if self.scheduler.get_request(request.request_id) is not request:
                continue  # finished meanwhile (its id may even be in use again)
            running = request.state is RequestStatus.RUNNING
            if self.machine.abort_if_active(request, reason) and running:
                aborted_running = True
        return aborted_running

    @staticmethod
    def _run_control(call: _ControlCall) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.fn())
        except BaseException as exc:
            call.future.set_exception(exc)

    def _end_all(self, error: EngineClosedError | EngineDeadError, trigger: Trigger) -> None:
        """End every active request, pending RPC and open stream with ``error``."""
        with self._lock:
            try:
                for request in self.scheduler.requests.values():
                    if request.sink is not None:
                        request.sink.fail(error)
                        request.sink = None
                self.scheduler.finish_all(trigger, str(error))
            finally:
                while self._control:
                    call = self._control.popleft()
                    if call.future.set_running_or_notify_cancel():
                        call.future.set_exception(error)
                self._flush_wakes()

    # -- output delivery (terminal hooks) --------------------------------------------------

    def _deliver_final(self, request: Request, event: LifecycleEvent) -> None:
        sink, request.sink = request.sink, None
        images, request.images = request.images, None
        if sink is None:  # the consumer is gone: the output is dropped
            if self.machine.traced:
                self._trace_delivery(request, None, event.dest)
            return
        scheduled = request.scheduled_time
        metrics = RequestMetrics(
            queue_time_s=(scheduled if scheduled is not None else event.time)
            - request.arrival_time,
            execution_time_s=0.0 if scheduled is None else event.time - scheduled,
            total_time_s=event.time - request.arrival_time,
        )
        completed = event.dest is RequestStatus.FINISHED_COMPLETED
        output = RequestOutput(
            request_id=request.request_id,
            status=event.dest,
            finished=True,
            image_batch=images,
            seed=request.seed,
            error=None if completed else event.reason,
            metrics=metrics,
            step=request.step_index if request.num_steps is not None else None,
            num_steps=request.num_steps,
        )
        if self.machine.traced:
            self._trace_delivery(request, output, event.dest)
        sink.push(output)

    def _deliver_progress(self, result: RunnerOutput) -> None:
        """Intermediate outputs: step i of n, with a preview image when there is one."""
        for request_id, (step, num_steps) in result.progress.items():
            request = self.scheduler.running.get(request_id)
            if request is None or request.sink is None:
                continue
            output = RequestOutput(
                request_id=request_id,
                status=RequestStatus.RUNNING,
                finished=False,
                image_batch=result.previews.get(request_id),
                seed=request.seed,
                step=step,
                num_steps=num_steps,
            )
            if self.machine.traced:
                self._trace_delivery(request, output, RequestStatus.RUNNING)
            request.sink.push(output)

    def _release_executor_bookkeeping(self, request: Request, event: LifecycleEvent) -> None:
        self._executor.release_request(request.request_id)

    def _note_wake(self, stream: AsyncStream) -> None:
        self._pending_wakes.setdefault(stream.loop, []).append(stream)

    def _flush_wakes(self) -> None:
        if not self._pending_wakes:
            return
        pending, self._pending_wakes = self._pending_wakes, {}
        for loop, streams in pending.items():
            try:
                loop.call_soon_threadsafe(wake_streams, streams)
            except RuntimeError:  # the consumer's event loop is closed
                for stream in streams:
                    stream.close()


def _digest(images: torch.Tensor) -> str:
    """A fingerprint of an image tensor's bytes."""
    raw = images.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def _fingerprint(request: Request) -> str:
    """A fingerprint of everything a request's output may depend on."""
    p = request.params
    inputs = (
        repr(request.prompt),
        request.seed,
        p.num_inference_steps,
        p.guidance_scale,
        p.num_outputs_per_prompt,
        p.height,
        p.width,
        sorted((k, repr(v)) for k, v in p.extra_args.items()),
    )
    return hashlib.blake2b(repr(inputs).encode(), digest_size=12).hexdigest()
