"""DiffusionEngine: the in-process front of an :class:`~diffusion_runtime.core.EngineCore`.

The front owns what callers see: request ids and seeds, validation, output
streams and their wake-ups, control calls, pause, and close. The core it wraps
is single-threaded, so exactly one thread at a time *drives* it (holds the
driver lock and calls ``core.step()`` in a loop):

- a blocking :meth:`DiffusionEngine.generate` drives the core on the calling
  thread, as an offline engine should: the pipeline runs on the caller's thread
  with the caller's torch thread team, and nothing else runs;
- the async API (:meth:`add_request` / :meth:`stream`) starts a loop thread the
  first time it is used, and that thread drives from then on (unless the engine
  was built with ``background_loop=False``: then the caller drives with
  :meth:`run_once`, as a test harness that steps the engine in lockstep does);
- a caller that finds another thread driving waits for its outputs.

Callers on any thread queue requests and aborts in the core's inbox (which
the core takes at the start of each step) and control calls in the front's
queue (which the driver runs between steps), under one condition variable that
wakes the driver; admission never waits for a wave.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any, Literal, overload

import attrs

from diffusion_runtime.admission import RequestMinter
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineCore, EngineSnapshot, EngineState, StepResult
from diffusion_runtime.engine_groups import EngineGroups
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    QueueFullError,
    RPCError,
    describe_error,
)
from diffusion_runtime.executor import UniProcExecutor, resolve_executor_class
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.executor.rpc_checks import checked_timeout
from diffusion_runtime.fsm import RequestMachine
from diffusion_runtime.fsm.audit import Auditor
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.request_groups import (
    check_group_params,
    checked_group_prompts,
    child_request_id,
)
from diffusion_runtime.routes import OutputRoutes
from diffusion_runtime.runner.worker import Worker
from diffusion_runtime.sampling_params import SamplingParams, checked_params, prompts_and_params
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.streams import (
    AsyncStream,
    GenerateWaiter,
    OutputSink,
    read_stream,
    wake_streams,
)

logger = logging.getLogger(__name__)

__all__ = ["DiffusionEngine", "EngineSnapshot", "EngineState"]


@attrs.define
class _ControlCall:
    """Work a caller asked the driver to run between two steps."""

    future: concurrent.futures.Future[Any]
    fn: Callable[[], Any]


#: A request on its way to the core: id, prompt, params, seed, arrival time.
_NewRequest = tuple[str, Any, SamplingParams, int, float]

_NO_STEP = StepResult([], False, None)

#: ``add_request``'s ``prompt`` when not given (``None`` is a prompt).
_NO_PROMPT: Any = object()


class DiffusionEngine:
    """Serves diffusion requests: admits them, runs them in waves, streams their outputs.

    Build one with :meth:`make_engine` (which also warms the model up) and close
    it with :meth:`close` or a ``with`` block. :attr:`core` is the
    :class:`~diffusion_runtime.core.EngineCore` it drives.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        scheduler_cls: type[BaseScheduler] | None = None,
        executor: DiffusionExecutor | None = None,
        background_loop: bool = True,
    ) -> None:
        self.core = EngineCore(config, scheduler_cls=scheduler_cls, executor=executor)
        self.config = config
        self._background_loop = background_loop
        self._minter = RequestMinter()
        # Guards the tables below; notified whenever they or the core's inbox change,
        # after every step, and when the driver leaves.
        self._changed = threading.Condition()
        self._control: deque[_ControlCall] = deque()
        self._routes = OutputRoutes()
        self._pending_wakes: dict[asyncio.AbstractEventLoop, list[AsyncStream]] = {}
        self._driver = threading.Lock()
        self._driver_thread: int | None = None
        self._loop_thread: threading.Thread | None = None
        self._closed = False
        self._fatal: EngineDeadError | None = None
        self._close_lock = threading.Lock()
        #: Grouped requests (``add_request(prompts=[...])``): parents over a child per prompt.
        self.groups = EngineGroups(self._abort_children, self._notify)

    @classmethod
    def make_engine(cls, config: EngineConfig, **kwargs: Any) -> DiffusionEngine:
        """Build an engine and run one warm-up request; close everything if either fails.

        With the in-process executor both run on a short-lived thread, so the
        torch work of building leaves no OpenMP team on the caller's thread: the
        thread that later drives the engine (the caller in ``generate``, or the
        loop thread) is then the process's only one (see the user guide on
        thread teams). Executors whose torch runs elsewhere build here."""
        built: concurrent.futures.Future[DiffusionEngine] = concurrent.futures.Future()

        def build() -> None:
            try:
                engine = cls(config, **kwargs)
            except BaseException as exc:
                built.set_exception(exc)
                return
            try:
                if config.warmup:
                    engine.core.warm_up()
            except BaseException as exc:
                engine.close()
                built.set_exception(exc)
                return
            built.set_result(engine)

        if "executor" in kwargs or not issubclass(resolve_executor_class(config), UniProcExecutor):
            build()
            return built.result()
        builder = threading.Thread(target=build, name="diffusion-build", daemon=True)
        builder.start()
        try:
            builder.join()
        except BaseException:  # interrupted while building: wait, then close what was built
            builder.join()
            if built.exception() is None:
                built.result().close()
            raise
        return built.result()

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def machine(self) -> RequestMachine[Request]:
        """The request machine: ``machine.subscribe(fn)`` receives every trace event."""
        return self.core.machine

    @property
    def auditor(self) -> Auditor | None:
        """The online auditor (``EngineConfig.audit`` other than ``"off"``)."""
        return self.core.auditor

    # -- requests ------------------------------------------------------------------------

    @overload
    def generate(
        self,
        prompts: list[Any] | tuple[Any, ...] | Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
        group: Literal[False] = False,
    ) -> list[RequestOutput]: ...

    @overload
    def generate(
        self,
        prompts: list[Any] | tuple[Any, ...],
        params: SamplingParams | None = None,
        *,
        timeout: float | None = None,
        group: Literal[True],
    ) -> RequestOutput: ...

    def generate(
        self,
        prompts: list[Any] | tuple[Any, ...] | Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
        group: bool = False,
    ) -> list[RequestOutput] | RequestOutput:
        """Run ``prompts`` to completion and return one final output per prompt, in order.

        ``prompts`` is a list or tuple of prompts; anything else is one prompt.
        ``params`` is one :class:`SamplingParams` for all prompts or one per
        prompt. With ``group=True`` the prompts (a list or tuple) run as one
        grouped request, with one ``params`` and one seed, and the call returns
        its one merged output (see :meth:`add_request` and ``docs/outputs.md``).
        A request that fails or is aborted yields an output saying why.
        The call raises for bad input (before anything is admitted), a full
        queue, ``timeout`` expiry, and the engine closing or dying meanwhile.
        Unless a loop thread drives the engine (the async API started one),
        the calling thread runs the steps itself.
        """
        self._refuse_reentry("generate()")
        timeout = checked_timeout(timeout, owner="generate")
        deadline = None if timeout is None else time.monotonic() + timeout
        if group:
            if params is not None and not isinstance(params, SamplingParams):
                rule = "must be one SamplingParams with group=True (the prompts share it)"
                raise InvalidFieldError("generate", "params", rule, params)
            parent_id, children = self._new_group(prompts, params, None)
            ids = [parent_id]
            waiter = GenerateWaiter(ids)
            self._admit_group(parent_id, children, waiter)
            return self._wait_for(ids, waiter, deadline, timeout)[0]
        prompt_list, params_list = prompts_and_params(prompts, params)
        requests = [
            self._new_request(prompt, p, None)
            for prompt, p in zip(prompt_list, params_list, strict=True)
        ]
        ids = [request[0] for request in requests]
        waiter = GenerateWaiter(ids)
        self._admit(requests, waiter)
        return self._wait_for(ids, waiter, deadline, timeout)

    def _wait_for(
        self,
        ids: list[str],
        waiter: GenerateWaiter,
        deadline: float | None,
        timeout: float | None,
    ) -> list[RequestOutput]:
        """Drive (or wait) until ``waiter`` has every final output of ``ids``; abort
        them if the call ends any other way."""
        try:
            if not self._run_until(lambda: waiter.done, deadline):
                raise TimeoutError(f"generate did not finish within {timeout} s")
            return waiter.result()
        except BaseException:
            self._abort_for(ids, waiter, "generate call was interrupted")
            if not self.core.is_paused:
                with contextlib.suppress(BaseException):  # let the aborts take effect now
                    self._run_until(lambda: waiter.done)
            raise

    async def add_request(
        self,
        prompt: Any = _NO_PROMPT,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompts: Sequence[Any] | None = None,
    ) -> str:
        """Admit one request and return its id; read its outputs with :meth:`stream`.

        With ``prompts`` (a list or tuple of 1 to 256 prompts) instead of
        ``prompt``, the request is a *grouped* one: a parent over one child
        request per prompt (``<request_id>/<index>``), all with ``params`` and
        one seed. Its stream yields one final output that merges its
        children's (images, latents and trajectories in prompt order); the
        first child that fails or is aborted ends it and aborts the others,
        and aborting it aborts every child (see ``docs/outputs.md``).

        Outputs are held for the caller until :meth:`stream` reads them, even
        when the request is aborted or finishes first. Validation that needs a
        worker process runs off the event loop.
        """
        loop = asyncio.get_running_loop()
        if prompts is not None:
            if prompt is not _NO_PROMPT:
                rule = "must not be given with prompt (one prompt, or a grouped request's prompts)"
                raise InvalidFieldError("request", "prompts", rule, prompts)
            if self.core.validates_in_process:
                parent_id, children = self._new_group(prompts, params, request_id)
            else:
                parent_id, children = await loop.run_in_executor(
                    None, self._new_group, prompts, params, request_id
                )
            stream = AsyncStream(loop, self._note_wake)
            self._admit_group(parent_id, children, stream, stream)
            self._ensure_loop_thread()
            return parent_id
        if prompt is _NO_PROMPT:
            raise InvalidFieldError("request", "prompt", "is required (or prompts)", None)
        if self.core.validates_in_process:
            request = self._new_request(prompt, params, request_id)
        else:
            request = await loop.run_in_executor(
                None, self._new_request, prompt, params, request_id
            )
        stream = AsyncStream(loop, self._note_wake)
        self._admit([request], stream, stream)
        self._ensure_loop_thread()
        return request[0]

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield a request's outputs until its final one.

        Raises ``KeyError`` at once for an id with no unclaimed stream, and
        ``RuntimeError`` when called on another event loop than the one that
        added the request. Iterating raises :class:`EngineClosedError` or
        :class:`EngineDeadError` if the engine ends first. Stopping early
        (``break``, cancellation) aborts the request: nobody is left to read
        its result.
        """
        with self._changed:
            stream = self._routes.claim(request_id)
        return read_stream(
            stream, lambda: self._abort_for([request_id], stream, "the consumer stopped reading")
        )

    def abort(
        self, request_ids: str | Iterable[str], reason: str = "aborted by the caller"
    ) -> None:
        """Abort requests before the next step. Ids unknown or finished at the time
        of the call are ignored (a later request that reuses the id is not aborted).

        An aborted request's stream still ends with its final output (aborted,
        or completed if the request won the race).
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        # The core applies aborts in order with admissions, so an abort queued now
        # never reaches a later request that reuses the id.
        with self._changed:
            targets = [rid for rid in ids if self._routes.sink_of(rid) is not None]
            if targets:
                self.core.abort(targets, reason)
                self._changed.notify_all()
        for request_id in ids:  # a grouped request's terminal hook aborts its children
            self.groups.abort(request_id, reason)

    def _abort_for(self, request_ids: Iterable[str], sink: OutputSink, reason: str) -> None:
        """Abort those of ``request_ids`` whose outputs still go to ``sink``."""
        ids = list(request_ids)
        with self._changed:
            targets = [rid for rid in ids if self._routes.sink_of(rid) is sink]
            if targets and self._fatal is None and not self._closed:
                self.core.abort(targets, reason)
                self._changed.notify_all()
        for request_id in ids:
            self.groups.abort(request_id, reason, sink)

    def _abort_children(self, child_ids: list[str], reason: str) -> None:
        """A grouped request ended: abort its children still running (unless the
        engine is ending, which ends them all)."""
        if self._fatal is None and not self._closed:
            self.core.abort(child_ids, reason)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- control -------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call a worker method between steps (so it never races a wave); see
        :meth:`DiffusionExecutor.collective_rpc`. The methods that run scheduler
        outputs are not callable here (only the scheduler decides what runs),
        nor ``sleep``/``wake_up`` (call :meth:`sleep` and :meth:`wake_up`)."""
        if method in Worker.RESERVED_METHODS:
            raise RPCError(f"method {method!r} is reserved for the executor and the core")
        timeout = checked_timeout(timeout)
        try:
            return self._between_steps(
                lambda: self.core.collective_rpc(method, args, kwargs, timeout, unique_reply_rank),
                timeout,
            )
        except concurrent.futures.TimeoutError:
            raise RPCError(f"collective_rpc {method!r} timed out after {timeout} s") from None

    # -- adapters (docs/lora.md) ------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter on every worker, between steps; False if already loaded.
        A worker that fails leaves the adapter loaded on none."""
        added: bool = self._between_steps(lambda: self.core.add_lora(request))
        return added

    def remove_lora(self, adapter_id: int) -> bool:
        """Unload an adapter everywhere; False if not loaded. Raises
        :class:`~diffusion_runtime.errors.LoRAError` while a request uses it."""
        removed: bool = self._between_steps(lambda: self.core.remove_lora(adapter_id))
        return removed

    def list_loras(self) -> list[int]:
        """The loaded adapter ids, merged across workers and sorted."""
        ids: list[int] = self._between_steps(self.core.list_loras)
        return ids

    def pin_lora(self, adapter_id: int) -> bool:
        """Never evict this adapter; False if it is not loaded."""
        pinned: bool = self._between_steps(lambda: self.core.pin_lora(adapter_id))
        return pinned

    def pause(self) -> None:
        """Stop starting waves (or steps) after the current one; requests and
        aborts queue up, while RPCs and snapshots still run. For maintenance,
        and for tests that need requests to pile up."""
        self.core.pause()

    def resume(self) -> None:
        """Undo :meth:`pause`. Every request admitted before this returns is seen
        by the first schedule after it, and every abort queued meanwhile applies
        before any wave."""
        with self._changed:
            self.core.resume()
            self._changed.notify_all()

    def sleep(self, level: int = 1) -> None:
        """Free the device's memory once the current wave or step ends, and start no
        wave until :meth:`wake_up`. Level 1 moves the weights to host memory,
        level 2 drops them (the pipeline reloads them on wake). Meanwhile requests
        are admitted and wait (a ``generate`` with a timeout times out), aborts
        apply, and step-mode requests already running resume after the wake
        where they stopped. See :meth:`EngineCore.sleep` and ``docs/operations.md``."""
        self._between_steps(lambda: self.core.sleep(level))

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed; outputs are bit-identical to before it.
        Raises :class:`~diffusion_runtime.errors.SleepStateError` when awake."""
        self._between_steps(self.core.wake_up)

    @property
    def is_sleeping(self) -> bool:
        return self.core.is_sleeping

    @property
    def state(self) -> EngineState:
        """The core's state: serving, paused, sleeping, dead or shut down."""
        return self.core.state

    def start_profile(self, prefix: str | None = None) -> list[str]:
        """Run ``torch.profiler`` on every worker from the next step on; returns the
        paths :meth:`stop_profile` writes, one per worker, in ``EngineConfig.profile_dir``
        (without it the call raises :class:`~diffusion_runtime.errors.ProfilingError`)."""
        paths: list[str] = self._between_steps(lambda: self.core.start_profile(prefix))
        return paths

    def stop_profile(self) -> list[str]:
        """Stop profiling and write one trace per worker; returns their paths."""
        paths: list[str] = self._between_steps(self.core.stop_profile)
        return paths

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the executor or the core has failed,
        :class:`EngineClosedError` once the engine is closed."""
        self._check_open()
        self.core.check_health()

    @property
    def queue_length(self) -> int:
        """Requests admitted and not yet scheduled."""
        return self.core.queue_length

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def unfinished_request_ids(self) -> frozenset[str]:
        """Requests admitted whose final output has not been delivered (a grouped
        request's children by their own ids; the parents are ``groups.active_ids``)."""
        with self._changed:
            return frozenset(self._routes.sinks)

    def snapshot(self) -> EngineSnapshot:
        """Per-request state held by the scheduler, the runner, the executor and the
        front's unread streams, taken between two steps (so all parts agree)."""

        def take() -> EngineSnapshot:
            snapshot = self.core.snapshot()
            with self._changed:
                unclaimed = frozenset(self._routes.unclaimed)
            return attrs.evolve(
                snapshot, unclaimed_stream_ids=unclaimed, group_ids=self.groups.active_ids
            )

        self._refuse_reentry("snapshot()")
        if self._closed or self._fatal is not None:
            return take()
        result: EngineSnapshot = self._between_steps(take)
        return result

    def close(self) -> None:
        """Stop driving, end every open stream with :class:`EngineClosedError`, and
        shut the core down. Idempotent; must not be called from a hook."""
        with self._close_lock:
            if self._closed:
                return
            self._refuse_reentry("close()")
            with self._changed:
                self._closed = True
                self._changed.notify_all()
            if self._loop_thread is not None:
                self._loop_thread.join()
            with self._driver:  # an inline driver finishes its step and leaves
                try:
                    self._end_callers(EngineClosedError("the engine was closed"))
                finally:
                    self.core.shutdown("the engine was closed")

    # -- admission -----------------------------------------------------------------------

    def _new_request(
        self, prompt: Any, params: SamplingParams | None, request_id: str | None
    ) -> _NewRequest:
        self._check_open()
        params = checked_params(params)
        request_id = self._minter.request_id(request_id)
        self.core.validate(prompt, params)
        return (request_id, prompt, params, self._minter.seed(params), self.core.clock())

    def _new_group(
        self, prompts: object, params: SamplingParams | None, request_id: str | None
    ) -> tuple[str, list[_NewRequest]]:
        """A grouped request's id and its children, checked: one seed and one
        arrival for all. A prompt the pipeline refuses is named by its index."""
        self._check_open()
        prompt_list = checked_group_prompts(prompts)
        params = checked_params(params)
        check_group_params(params)
        parent_id = self._minter.request_id(request_id)
        for index, prompt in enumerate(prompt_list):
            try:
                self.core.validate(prompt, params)
            except InvalidFieldError as exc:
                if exc.field != "prompt":
                    raise
                raise InvalidFieldError(exc.owner, f"prompts[{index}]", exc.rule, prompt) from None
        seed, arrival = self._minter.seed(params), self.core.clock()
        children = [
            (child_request_id(parent_id, index), prompt, params, seed, arrival)
            for index, prompt in enumerate(prompt_list)
        ]
        return parent_id, children

    def _admit(
        self, requests: list[_NewRequest], sink: OutputSink, stream: AsyncStream | None = None
    ) -> None:
        """Queue all of ``requests`` for the core, or none of them.

        An id is taken from admission until its final output is delivered, and
        after that while an ``add_request`` stream holds it unread.
        """
        with self._changed:
            self._queue_for_core(requests)
            self._routes.open({request[0]: sink for request in requests}, stream)
            self._changed.notify_all()

    def _admit_group(
        self,
        parent_id: str,
        children: list[_NewRequest],
        sink: OutputSink,
        stream: AsyncStream | None = None,
    ) -> None:
        """Queue a grouped request's children for the core and start its parent,
        whose final output goes to ``sink`` (or none of it). The parent's id is
        taken as a request's is."""
        with self._changed:
            self._check_taken_by_group(parent_id)
            self._routes.check_free([parent_id])
            self._queue_for_core(children)
            child_ids = [child[0] for child in children]
            child_sink = self.groups.open(parent_id, child_ids, children[0][3], sink)
            self._routes.open(dict.fromkeys(child_ids, child_sink))
            if stream is not None:
                self._routes.unclaimed[parent_id] = stream
            self._changed.notify_all()

    def _queue_for_core(self, requests: list[_NewRequest]) -> None:
        """Check that the ids are free and the queue has room, then queue them all
        (under the lock)."""
        limit = self.config.max_waiting_requests
        self._check_open()
        self._routes.check_free(request[0] for request in requests)
        for request in requests:
            self._check_taken_by_group(request[0])
        if limit is not None and self.queue_length + len(requests) > limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests); retry later")
        for request in requests:
            self.core.add_request(*request)

    def _check_taken_by_group(self, request_id: str) -> None:
        if self.groups.is_taken(request_id):
            raise DuplicateRequestError(
                f"request id {request_id!r} is taken: its grouped request is active"
            )

    def run_once(self) -> bool:
        """Drive the core once on this thread: run the control calls queued so far,
        take one step, and deliver its outputs to their streams. Returns whether
        the step did anything (ran a wave or delivered an output).

        For callers that drive the engine themselves (``background_loop=False``);
        raises ``RuntimeError`` while another thread drives it.
        """
        self._refuse_reentry("run_once()")
        self._check_open()
        if not self._driver.acquire(blocking=False):
            raise RuntimeError("another thread drives the engine")
        self._driver_thread = threading.get_ident()
        try:
            self._run_control_calls()
            result = self._step_and_deliver()
            return result.executed or bool(result.outputs)
        finally:
            self._leave_driving()

    def _refuse_reentry(self, what: str) -> None:
        """Hooks run on the driving thread: calling back into the engine from
        there would deadlock, so it is an error."""
        if self._driver_thread == threading.get_ident():
            raise RuntimeError(f"{what} cannot be made from a lifecycle hook or the engine loop")

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise EngineClosedError("the engine is closed; it accepts no requests")

    # -- driving -------------------------------------------------------------------------

    def _between_steps(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the driving thread between two steps and return its result."""
        self._refuse_reentry("this call")
        call = _ControlCall(concurrent.futures.Future(), fn)
        with self._changed:  # close and death fail the queue under this lock
            self._check_open()
            self._control.append(call)
            self._changed.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._run_until(call.future.done, deadline):
            call.future.cancel()
            raise concurrent.futures.TimeoutError
        return call.future.result()

    def _run_until(self, done: Callable[[], bool], deadline: float | None = None) -> bool:
        """Drive the core on this thread until ``done()``, or wait while another
        thread drives. False if ``deadline`` passed first."""
        while not done():
            if self._closed or self._fatal is not None:
                # Closing or dead: whoever ends the engine fails every caller and notifies.
                with self._changed:
                    if not done():
                        self._changed.wait(_remaining(deadline))
            elif self._driver.acquire(blocking=False):
                self._driver_thread = threading.get_ident()
                try:
                    self._drive(done, deadline)
                finally:
                    self._leave_driving()
            else:
                with self._changed:
                    if not done() and self._driver.locked():
                        self._changed.wait(_remaining(deadline))
            if deadline is not None and time.monotonic() >= deadline:
                return done()
        return True

    def _drive(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Steps until ``done()``, the deadline, close or death; idles when nothing can run."""
        while True:
            self._run_control_calls()
            if self._should_stop(done, deadline):
                return
            result = self._step_and_deliver()
            if self._should_stop(done, deadline):
                return
            self._idle(deadline, result)

    def _step_and_deliver(self) -> StepResult:
        result = self._step()
        self._deliver(result.outputs)
        return result

    def _leave_driving(self) -> None:
        """Release the driver lock and wake whoever waits for it or for outputs."""
        self._driver_thread = None
        with self._changed:
            self._driver.release()
            self._changed.notify_all()

    def _should_stop(self, done: Callable[[], bool], deadline: float | None) -> bool:
        if done() or self._closed or self._fatal is not None:
            return True
        return deadline is not None and time.monotonic() >= deadline

    def _run_control_calls(self) -> None:
        """Run the control calls queued so far (after the requests and aborts their
        callers queued before them, which the last step took)."""
        with self._changed:
            control = list(self._control)
            self._control.clear()
        if control:
            for call in control:
                _run_control(call)
            with self._changed:  # their callers wait for this
                self._changed.notify_all()

    def _step(self) -> StepResult:
        try:
            return self.core.step()
        except EngineDeadError as error:
            self._die(error)
            return _NO_STEP

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with self._changed:  # a final output frees its id
            targets = [(output, self._routes.route(output)) for output in outputs]
        for output, sink in targets:
            if sink is not None:
                sink.push(output)
        self._flush_wakes()
        with self._changed:  # after the pushes, so a waiter that wakes sees them
            self._changed.notify_all()

    def _idle(self, deadline: float | None, result: StepResult) -> None:
        """Wait until the step ``result`` asks for, new input, or the deadline."""
        with self._changed:
            if self._control or self._closed or self.core.has_input():
                return
            waits = [result.wait_s(self.core.clock())]
            if deadline is not None:
                waits.append(deadline - time.monotonic())
            timeouts = [max(0.0, w) for w in waits if w is not None]
            timeout = min(timeouts) if timeouts else None
            if timeout != 0.0:
                self._changed.wait(timeout)

    def _ensure_loop_thread(self) -> None:
        """The async API's streams need a driver that outlives any one call."""
        with self._changed:
            if self._loop_thread is not None or self._closed or not self._background_loop:
                return
            self._loop_thread = threading.Thread(
                target=self._run_loop, name="diffusion-engine-loop", daemon=True
            )
            self._loop_thread.start()

    def _run_loop(self) -> None:
        try:
            self._run_until(lambda: self._closed or self._fatal is not None)
        except BaseException as exc:  # a bug in the front: nothing may be left waiting
            logger.exception("the engine loop crashed")
            error = EngineDeadError(f"the engine loop crashed: {describe_error(exc)}")
            self._die(error)

    # -- the end -------------------------------------------------------------------------

    def _die(self, error: EngineDeadError) -> None:
        """The core died: every caller gets ``error``."""
        if self._fatal is None:
            self._fatal = error
        self._end_callers(error)

    def _end_callers(self, error: EngineClosedError | EngineDeadError) -> None:
        """Fail every admitted request's sink and every pending control call."""
        with self._changed:
            sinks = self._routes.close_all()
            control = list(self._control)
            self._control.clear()
        for call in control:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(error)
        for sink in sinks:
            sink.fail(error)
        self._flush_wakes()
        with self._changed:
            self._changed.notify_all()

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


def _run_control(call: _ControlCall) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn())
    except BaseException as exc:
        call.future.set_exception(exc)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
