"""EngineCore: the synchronous heart of the runtime.

One core owns the request machine, the scheduler, the executor and an inbox.
It has no thread of its own: any thread may queue requests and aborts (and
pause or resume), and whoever drives the core calls :meth:`EngineCore.step` in
a loop. Each step is

1. take the inbox (unless paused): admit its requests and apply its aborts, in order;
2. ``scheduler.schedule()`` picks a wave and returns a ``SchedulerOutput``;
3. ``executor.execute(output)`` runs it on the workers;
4. take the inbox again: aborts that arrived during the wave win over its results;
5. ``scheduler.update_from_output()`` fires the transitions the results decide;
6. the step returns a :class:`StepResult`: this step's outputs, built as values
   from those transitions, whether a wave ran, and when to step next.

A wave comes back from the executor once its work is enqueued (compute done);
its images may still be on their way to host memory. Its outputs wait in a
:class:`~diffusion_runtime.delivery_queue.DeliveryQueue` until their fence says
the copy is done (output ready), while later steps are already scheduled. On
the CPU every fence is ready at once, and outputs leave with their own step.

Hooks on the machine only clean tables and release resources; nothing reaches
a caller through a hook. Fronts (:class:`~diffusion_runtime.engine.DiffusionEngine`,
the stage) add ids, validation, seeds, streams and threads on top; a custom
engine can drive a core from its own loop.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import attrs
import torch

from diffusion_runtime.cache_settings import CacheSettings, effective_cache
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.delivery_queue import DeliveryQueue
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidFieldError,
    LoRAError,
    ProfilingError,
    QueueFullError,
    SleepStateError,
    describe_error,
)
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.executor.selection import resolve_executor_class
from diffusion_runtime.fsm import (
    STARTED_STATES,
    Hook,
    LifecycleEvent,
    RequestMachine,
    RequestStatus,
    Trigger,
)
from diffusion_runtime.fsm.audit import Auditor, InvariantViolation, Violation
from diffusion_runtime.fsm.events import (
    AbortEvent,
    AdapterEvent,
    DeliveryEvent,
    EngineEvent,
    RunnerEvent,
    WaveEvent,
)
from diffusion_runtime.fsm.trace import JsonlTraceWriter
from diffusion_runtime.inbox import CoreInbox, Queued, QueuedAbort, QueuedRequest
from diffusion_runtime.lora.control import AdapterControl
from diffusion_runtime.lora.weights import AdapterFileError
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import (
    STAGES,
    RequestMetrics,
    RequestOutput,
    Trajectory,
    images_digest,
)
from diffusion_runtime.runner.profiling import checked_profile_prefix
from diffusion_runtime.runner.sleep import checked_sleep_level
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.base import BaseScheduler, Ended
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.scheduler.step_scheduler import StepScheduler

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The id of the warm-up request (:meth:`EngineCore.warm_up`).
WARMUP_REQUEST_ID = "warmup"

#: An output and the request it belongs to (traced when it is delivered).
_Outgoing = tuple[Request, RequestOutput]


class EngineState(enum.Enum):
    """What an engine core is doing, as one value (:attr:`EngineCore.state`)."""

    SERVING = "serving"
    #: :meth:`EngineCore.pause`: no wave starts; requests and aborts queue up.
    PAUSED = "paused"
    #: :meth:`EngineCore.sleep`: the workers freed their device memory; requests
    #: are admitted and wait, aborts apply, no wave starts.
    SLEEPING = "sleeping"
    DEAD = "dead"
    SHUT_DOWN = "shut_down"


@attrs.frozen
class EngineSnapshot:
    """What the engine and its workers hold right now, by request id (for checks and audits).

    ``runner_offloaded_ids`` are the ``runner_cached_ids`` whose state is in host
    memory (``EngineConfig.preempted_offload_bytes``). ``group_ids`` are the
    in-process engine's grouped requests whose final output is not delivered.
    """

    scheduler_ids: frozenset[str]
    running_ids: frozenset[str]
    waiting: int
    runner_cached_ids: frozenset[str]
    unclaimed_stream_ids: frozenset[str]
    runner_offloaded_ids: frozenset[str] = frozenset()
    group_ids: frozenset[str] = frozenset()


@attrs.frozen
class StepResult:
    """What one :meth:`EngineCore.step` did.

    ``outputs``: the outputs it produced, in order. ``executed``: whether it
    sent a wave (or a release) to the workers. ``wake_at`` (on the core's
    clock): when the core next needs a step if nothing new arrives; ``None``
    means only new input (or :meth:`EngineCore.resume`, or
    :meth:`EngineCore.wake_up`) gives it work.
    """

    outputs: list[RequestOutput]
    executed: bool
    wake_at: float | None

    def wait_s(self, now: float) -> float | None:
        """How long a driver may sleep before the next step (``None``: until input)."""
        return None if self.wake_at is None else max(0.0, self.wake_at - now)


class EngineCore:
    """Admits requests, runs them one step at a time, and returns their outputs.

    :meth:`add_request`, :meth:`abort`, :meth:`pause`, :meth:`resume` and
    :attr:`queue_length` may be called from any thread; everything else from
    the one thread that drives the core. A request's input must have passed
    :meth:`validate` (fronts do this before admitting it).
    After :class:`EngineDeadError` the core is dead for good: every request
    has failed and every later :meth:`step` raises the same error.

    ``clock`` (seconds, never decreasing; default :func:`time.monotonic`) is the
    time of the requests: their arrival and deadline, the ``now`` a step
    schedules and drops late requests at, aging, the step cost model and the
    timings in their outputs. A test may pass a virtual clock to make all of
    these deterministic. Trace events keep the real monotonic time.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        scheduler_cls: type[BaseScheduler] | None = None,
        executor: DiffusionExecutor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig; got {type(config).__name__}")
        self.config = config
        self.clock = clock
        self.machine: RequestMachine[Request] = RequestMachine()
        self.auditor: Auditor | None = None
        self._trace_writer: JsonlTraceWriter | None = None
        self._traced_waves: set[int] = set()
        self._pending: list[_Outgoing] = []
        self._deliveries: DeliveryQueue[_Outgoing] = DeliveryQueue()
        # Delivered by a step that a KeyboardInterrupt stopped: returned by the next one.
        self._interrupted_outputs: list[RequestOutput] = []
        # Final outputs of queued requests the scheduler refused (an id raced another
        # thread's request): they have no lifecycle, so they are not traced.
        self._refused: list[RequestOutput] = []
        self._last_batch_key: tuple[SamplingParams | None, Hashable] = (None, None)
        self._dead: EngineDeadError | None = None
        self._shut_down = False
        self._sleep_level: int | None = None
        # Set when an abort ends a running request whose runner state the workers
        # hold: released before the core returns, so no caller ever sees it held.
        self._release_due = False
        self._inbox = CoreInbox()
        self._adapters = (
            AdapterControl(
                self._call_all, self._adapters_in_use, config.lora_capacity, self._adapter_event
            )
            if config.max_loras
            else None
        )
        self.executor = executor if executor is not None else resolve_executor_class(config)(config)
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
            self.scheduler.clock = clock
            self.machine.add_hook(Hook.TERMINAL, self._drop_intermediate_outputs)
        except BaseException:
            self.executor.shutdown()
            self._end_trace(EngineEvent("dead", time.monotonic(), "start-up failed"))
            raise

    # -- requests ------------------------------------------------------------------------

    def validate(self, prompt: Any, params: SamplingParams) -> None:
        """Raise :class:`~diffusion_runtime.errors.InvalidFieldError` for input the
        pipeline cannot serve (on mp, a round trip to a worker), for an
        adapter that is not loaded and whose file cannot be read, for a
        trajectory longer than ``max_trajectory_steps``, or for one to stream
        from an engine without ``streaming_output``."""
        if params.lora is not None:
            self._validate_lora(params.lora)
        if params.stream_trajectory and not self.config.streaming_output:
            raise InvalidFieldError(
                "SamplingParams",
                "stream_trajectory",
                "needs an engine with EngineConfig.streaming_output=True (progress outputs)",
                params.stream_trajectory,
            )
        limit = self.config.max_trajectory_steps
        if params.return_trajectory and params.num_inference_steps > limit:
            rule = (
                f"needs num_inference_steps at most EngineConfig.max_trajectory_steps ({limit}); "
                f"got {params.num_inference_steps} steps"
            )
            raise InvalidFieldError(
                "SamplingParams", "return_trajectory", rule, params.return_trajectory
            )
        self.executor.validate_request(prompt, params)

    def _validate_lora(self, lora: LoRARequest) -> None:
        if self._adapters is None:
            raise InvalidFieldError(
                "SamplingParams", "lora", "needs an engine with EngineConfig.max_loras > 0", lora
            )
        try:
            self._adapters.check_loadable(lora)
        except AdapterFileError as exc:  # loaded from another file (workers check the rest)
            rule = f"names adapter {lora.adapter_id} with another file than the loaded one: {exc}"
            raise InvalidFieldError("SamplingParams", "lora", rule, lora) from exc

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        seed: int,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a validated request; the next :meth:`step` admits it at the back
        of the waiting queue, before it schedules. Any thread may call this.

        ``arrival_time`` (on the core's clock) defaults to now. Raises
        :class:`~diffusion_runtime.errors.DuplicateRequestError` for an id in
        use and :class:`~diffusion_runtime.errors.QueueFullError` at
        ``max_waiting_requests`` (queued and waiting requests together); the
        request is then not queued.
        """
        self._check_alive()
        arrival = self.clock() if arrival_time is None else arrival_time
        queued = QueuedRequest(request_id, prompt, params, seed, arrival)
        self._inbox.put_request(queued, lambda num_queued: self._check_room(request_id, num_queued))

    def _check_room(self, request_id: str, num_queued: int) -> None:
        if request_id in self.scheduler.requests:
            raise DuplicateRequestError(
                f"request id {request_id!r} is already in use by an active request"
            )
        limit = self.config.max_waiting_requests
        if limit is not None and num_queued + self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests); retry later")

    def abort(self, request_ids: Iterable[str], reason: str = "aborted by the caller") -> None:
        """Queue an abort; the next :meth:`step` applies it before it schedules (or,
        inside a step, once its wave ran, so it wins over the wave's results).
        Any thread may call this.

        Ids unknown or finished when the abort is applied are ignored: a caller
        racing a completion is normal. The runner state of an aborted running
        request is released before the step that applied the abort returns.
        """
        self._check_alive()
        self._inbox.put_abort(QueuedAbort(tuple(request_ids), reason))

    def pause(self) -> None:
        """Start no wave until :meth:`resume`; requests and aborts queue up meanwhile.
        A step that is running finishes. Any thread may call this."""
        self._inbox.pause()

    def resume(self) -> None:
        """Undo :meth:`pause`. The first step after it takes everything queued before
        this returned: requests admitted meanwhile share its schedule, and aborts
        queued meanwhile apply before any wave. Any thread may call this."""
        self._inbox.resume()

    @property
    def validates_in_process(self) -> bool:
        """Whether :meth:`validate` runs without waiting on a worker (an async front
        may then call it on its event loop)."""
        return self.executor.validates_in_process

    @property
    def is_paused(self) -> bool:
        return self._inbox.paused

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    @property
    def state(self) -> EngineState:
        """Dead, shut down, sleeping, paused or serving (the first that holds)."""
        if self._dead is not None:
            return EngineState.DEAD
        if self._shut_down:
            return EngineState.SHUT_DOWN
        if self._sleep_level is not None:
            return EngineState.SLEEPING
        return EngineState.PAUSED if self._inbox.paused else EngineState.SERVING

    @property
    def queue_length(self) -> int:
        """Requests queued or admitted and not yet scheduled."""
        return self._inbox.num_requests + self.scheduler.num_waiting

    def has_input(self) -> bool:
        """Whether requests or aborts are queued and not held by a pause."""
        return self._inbox.has_input()

    def has_unfinished(self) -> bool:
        """Whether a :meth:`step` has anything to do: queued input, requests,
        outputs, or releases."""
        return (
            self._inbox.has_input()
            or self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or bool(self._interrupted_outputs)
            or bool(self._deliveries)
            or self.scheduler.has_pending_release()
        )

    def _take_inbox(self, queued: list[Queued]) -> None:
        """Admit the queued requests and apply the queued aborts, in the order they came."""
        for item in queued:
            if isinstance(item, QueuedRequest):
                self._admit(item)
            else:
                self._apply_abort(item)

    def _admit(self, queued: QueuedRequest) -> None:
        # One params object is often shared by many prompts: compute its key once.
        params = queued.params
        cached_params, batch_key = self._last_batch_key
        if params is not cached_params:
            batch_key = self.scheduler.batch_key_for(params)
            self._last_batch_key = (params, batch_key)
        request = Request(
            queued.request_id, queued.prompt, params, queued.seed, batch_key, queued.arrival_time
        )
        # At shutdown a queued request is admitted only to be aborted: it loads nothing.
        lora = None if self._adapters is None or self._shut_down else params.lora
        if lora is not None and self._adapters is not None:
            try:
                self._adapters.ensure(lora)  # loads it on demand
            except EngineDeadError:
                raise
            except Exception as exc:  # no room, or a worker failed to load it
                self._adapter_event("refused", lora.adapter_id, queued.request_id)
                self._refused.append(_refused(queued, exc))
                return
        try:
            self.scheduler.add_request(request)
        except (DuplicateRequestError, QueueFullError) as exc:  # raced another thread's request
            self._refused.append(_refused(queued, exc))
            return
        if lora is not None:
            self._adapter_event("used", lora.adapter_id, queued.request_id)

    def _apply_abort(self, abort: QueuedAbort) -> None:
        for request_id in abort.request_ids:
            if self.machine.traced:
                self.machine.publish(AbortEvent(request_id, abort.reason, time.monotonic()))
            ended = self.scheduler.abort_request(request_id, abort.reason)
            if ended is not None:
                self._pending.append(self._final_output(ended, None))
                if ended.event.source in STARTED_STATES and self.scheduler.keeps_runner_state:
                    self._release_due = True

    # -- one step ------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Take the inbox, run one wave (or one denoising step), and return what it produced.

        Outputs of aborts come first. Aborts queued while the workers ran the
        wave are applied before its results are committed, and win over them.
        While paused, a step only delivers outputs already due. A failed wave
        fails its requests; a dead executor, or an error inside the core
        itself, kills the core: every request fails and
        :class:`EngineDeadError` is raised. A ``KeyboardInterrupt`` while the
        workers run a wave fails that wave's requests (their outputs come with
        the next step) and is re-raised; the core lives on.
        """
        self._check_alive()
        return self._guarded(self._step)

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; any error but an interrupted wave kills the core."""
        try:
            return fn()
        except _WaveInterrupted:
            raise KeyboardInterrupt from None
        except BaseException as exc:
            error = _as_dead(exc)
            self._die(error)
            if error is exc:
                raise
            raise error from exc

    def _step(self) -> StepResult:
        outputs, self._interrupted_outputs = self._interrupted_outputs, []
        queued = self._inbox.take()
        if queued is None:  # paused: start nothing
            return StepResult(outputs + self._delivered(wait=True), False, None)
        self._take_inbox(queued)
        outputs += self._take_refused()
        self._deliveries.put(self._pending)
        self._pending = []
        self._release_due = False  # this step's output carries every id finished so far
        self.executor.check_health()
        now = self.clock()
        expired = self.scheduler.expire_waiting(now)
        self._deliveries.put(self._final_output(ended, None) for ended in expired)
        if self._sleep_level is not None:  # asleep: admit, abort and release; run nothing
            self._send_release()
            outputs += self._delivered(wait=True)
            wakeup = self.scheduler.next_wakeup()  # a deadline that drops a waiting request
            due = wakeup if wakeup is not None and wakeup > now else None
            return StepResult(outputs, False, due)
        output = self._trace_wave(self.scheduler.schedule(now))
        if output is None:  # nothing left to overlap with: wait for copies in flight
            outputs += self._delivered(wait=True)
            return StepResult(outputs, False, self._wake_at(executed=False))
        interrupted = False
        started = time.perf_counter()
        try:
            result = self._execute(output)
        except KeyboardInterrupt:
            interrupted = True
            result = self._failed_wave(output, "the wave was interrupted (KeyboardInterrupt)")
        self._trace_runner(result)
        # This wave's work is enqueued: now wait for the copies of earlier waves, so a
        # request's outputs are out before its terminal transition can come.
        outputs += self._delivered(wait=True)
        outputs += self._take_wave_inbox()
        # Measured here, not by each scheduler: one that forgot would learn no costs.
        self.scheduler.cost_meter.wave_ran(output, self.clock())
        self._charge_costs(output, result, time.perf_counter() - started)
        self._commit(output, result)
        if self._release_due:
            self._send_release()
        if interrupted:  # the outputs come with the next step
            self._interrupted_outputs = outputs
            raise _WaveInterrupted
        outputs += self._delivered(wait=False)
        return StepResult(outputs, True, self._wake_at(executed=True))

    def _take_wave_inbox(self) -> list[RequestOutput]:
        """Take what was queued while the workers ran the wave, before its results
        are committed: its aborts win over them. Returns refused requests' outputs."""
        queued = self._inbox.take()
        if not queued:
            return []
        self._take_inbox(queued)
        self._deliveries.put(self._pending)
        self._pending = []
        return self._take_refused()

    def _commit(self, output: SchedulerOutput, result: RunnerOutput) -> None:
        """Fire the transitions a wave's results decide and queue their outputs."""
        produced = [
            self._final_output(ended, result)
            for ended in self.scheduler.update_from_output(output, result)
        ]
        if self.config.streaming_output and result.progress:
            produced.extend(self._progress_outputs(result))
        self._deliveries.put(produced, result.output_ready)

    def _charge_costs(
        self, output: SchedulerOutput, result: RunnerOutput, wave_seconds: float
    ) -> None:
        """Add what the wave cost to each of its requests: the worker's phase times,
        and as transfer the rest of the wave's time as the core saw it."""
        costs = result.costs
        if costs is None:
            return
        transfer_s = max(0.0, wave_seconds - costs.seconds)
        running = self.scheduler.running
        for request_id in output.scheduled_ids:
            request = running.get(request_id)
            if request is not None:
                phases = costs.phases.get(request_id, {})
                steps = costs.steps.get(request_id, (0, 0))
                request.charge(phases, transfer_s, costs.peak_memory_bytes, steps)

    def _wake_at(self, *, executed: bool) -> float | None:
        """When the next step is due: now while work is left, else the scheduler's
        wake-up (it waits to fill a wave or for a deadline), else on input."""
        if not self.has_unfinished():
            return None
        wakeup = self.scheduler.next_wakeup()
        return self.clock() if executed or wakeup is None else wakeup

    def _take_refused(self) -> list[RequestOutput]:
        refused, self._refused = self._refused, []
        return refused

    def _execute(self, output: SchedulerOutput) -> RunnerOutput:
        try:
            return self.executor.execute(output)
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.exception("executor failed on wave %d", output.wave_id)
            return self._failed_wave(output, describe_error(exc))

    def _failed_wave(self, output: SchedulerOutput, reason: str) -> RunnerOutput:
        # The workers may not have seen the finished ids: tell them again next time.
        self.scheduler.requeue_finished_ids(output.finished_ids)
        return RunnerOutput.failed(output.wave_id, output.scheduled_ids, reason)

    # -- outputs -------------------------------------------------------------------------

    def _delivered(self, *, wait: bool) -> list[RequestOutput]:
        """Outputs whose tensors are in host memory, in order; traced as they leave."""
        delivered = self._deliveries.take(wait=wait)
        if self.machine.traced:
            for request, output in delivered:
                self._trace_delivery(request, output)
        return [output for _, output in delivered]

    def _drop_intermediate_outputs(self, request: Request, event: LifecycleEvent) -> None:
        """A request that ended gets no more previews, even ones still being copied."""
        request_id = request.request_id
        self._deliveries.discard(
            lambda item: item[1].request_id == request_id and not item[1].finished
        )

    def _final_output(self, ended: Ended, result: RunnerOutput | None) -> _Outgoing:
        request, event = ended
        completed = event.dest is RequestStatus.FINISHED_COMPLETED
        products = _Products.of(request, result) if completed else _Products()
        finished = request.finished_time
        if finished is None:  # a scheduler whose terminal hook does not stamp it
            finished = self.clock()
        output = RequestOutput(
            request_id=request.request_id,
            status=event.dest,
            finished=True,
            image_batch=products.images,
            seed=request.seed,
            error=None if completed else event.reason,
            metrics=_metrics(request, finished),
            step=request.step_index if request.num_steps is not None else None,
            num_steps=request.num_steps,
            latents=products.latents,
            trajectory=products.trajectory,
        )
        return request, output

    def _progress_outputs(self, result: RunnerOutput) -> list[_Outgoing]:
        """Intermediate outputs: step i of n, with a preview image when there is one
        and the new part of the trajectory when the request streams it."""
        outputs = []
        for request_id, (step, num_steps) in result.progress.items():
            request = self.scheduler.running.get(request_id)
            if request is None:  # it finished in this step: its final output says so
                continue
            output = RequestOutput(
                request_id=request_id,
                status=RequestStatus.RUNNING,
                finished=False,
                image_batch=result.previews.get(request_id),
                seed=request.seed,
                step=step,
                num_steps=num_steps,
                trajectory=_trajectory(result, request_id, end_step=step),
            )
            outputs.append((request, output))
        return outputs

    # -- control -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Run the pipeline's warm-up request (if it names one) to its end before
        serving; raise if it fails. Call it before any other request is queued."""
        warmup = self.collective_rpc("warmup_request", unique_reply_rank=0)
        if warmup is None:
            return
        prompt, params = warmup
        self.validate(prompt, params)
        self.add_request(WARMUP_REQUEST_ID, prompt, params, params.seed or 0)
        while self.has_unfinished():
            for output in self.step().outputs:
                if output.finished and not output.ok:
                    raise RuntimeError(f"the warm-up request failed: {output.error}")

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the core or its executor has failed or
        the core was shut down."""
        self._check_alive()
        self.executor.check_health()

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call a worker method on every worker; see :meth:`DiffusionExecutor.collective_rpc`."""
        self._check_alive()
        return self.executor.collective_rpc(method, args, kwargs or {}, timeout, unique_reply_rank)

    # -- adapters (docs/lora.md; call between steps, on the driving thread) ------------

    def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter on every worker (all or none); False if already loaded."""
        return self._adapter_control().add(request)

    def remove_lora(self, adapter_id: int) -> bool:
        """Unload an adapter from every worker; False if not loaded. Raises
        :class:`~diffusion_runtime.errors.LoRAError` while a waiting, running or
        preempted request uses it."""
        return self._adapter_control().remove(adapter_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters loaded on the workers, merged and sorted."""
        return [] if self._adapters is None else self._adapters.list()

    def pin_lora(self, adapter_id: int) -> bool:
        """Never evict this adapter; False if it is not loaded."""
        return self._adapter_control().pin(adapter_id)

    def _adapter_control(self) -> AdapterControl:
        self._check_alive()
        if self._adapters is None:
            raise LoRAError("adapters are off: EngineConfig.max_loras is 0")
        return self._adapters

    def _call_all(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        replies: list[Any] = self.collective_rpc(method, args)
        return replies

    def _adapter_event(self, action: str, adapter_id: int, request_id: str | None = None) -> None:
        if self.machine.traced:
            config = self.config
            self.machine.publish(
                AdapterEvent(
                    action,
                    adapter_id,
                    time.monotonic(),
                    request_id,
                    config.max_loras,
                    config.lora_capacity,
                )
            )

    def _adapters_in_use(self) -> set[int]:
        """Adapters of the waiting, running and preempted requests."""
        return {
            request.params.lora.adapter_id
            for request in self.scheduler.requests.values()
            if request.params.lora is not None
        }

    def sleep(self, level: int = 1) -> None:
        """Free the workers' device memory; start no wave until :meth:`wake_up`.

        Call it between steps, so the current wave or step has ended. While
        asleep, requests are admitted and wait, aborts apply, and requests
        running in step mode stay running: their step state moves to host
        memory and they resume unchanged after :meth:`wake_up`. Level 1 moves
        the weights to host memory; level 2 drops them, and the pipeline
        reloads them from its source on wake (``docs/operations.md``).

        Raises ``InvalidFieldError`` for another level, :class:`SleepStateError` when
        already asleep, and what the workers raise when they refuse (such as
        :class:`~diffusion_runtime.errors.PipelineContractError` at level 2 for
        a pipeline without ``reload_weights``); the core is then still awake.
        """
        self._check_alive()
        level = checked_sleep_level(level)
        if self._sleep_level is not None:
            raise SleepStateError(f"the engine is already asleep (level {self._sleep_level})")
        try:
            self.executor.sleep(level)
        except BaseException:
            # Workers that did sleep wake again (a worker's wake is a no-op while awake).
            try:
                self.executor.wake_up()
            except Exception:
                logger.exception("waking the workers after a failed sleep failed")
            raise
        self._sleep_level = level
        if self.machine.traced:
            self.machine.publish(EngineEvent("sleeping", time.monotonic(), f"level {level}"))

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed, exactly, and serve again: outputs are
        bit-identical to those before the sleep. Raises :class:`SleepStateError`
        when awake; if the workers fail to wake, the core stays asleep."""
        self._check_alive()
        if self._sleep_level is None:
            raise SleepStateError("the engine is awake; wake_up follows sleep")
        self.executor.wake_up()
        self._sleep_level = None
        if self.machine.traced:
            self.machine.publish(EngineEvent("awake", time.monotonic()))

    def start_profile(self, prefix: str | None = None) -> list[str]:
        """Run ``torch.profiler`` on every worker until :meth:`stop_profile`; returns
        the trace paths, one per worker: ``<profile_dir>/<prefix>-rank<r>.json``.

        ``prefix`` (default: ``profile-<nanoseconds>``) is a plain file-name part.
        Raises :class:`ProfilingError` without ``EngineConfig.profile_dir``, for a
        bad prefix, or while profiling."""
        self._check_alive()
        if self.config.profile_dir is None:
            raise ProfilingError("profiling is off: set EngineConfig(profile_dir=...)")
        prefix = checked_profile_prefix(f"profile-{time.time_ns()}" if prefix is None else prefix)
        return self.executor.start_profile(prefix)

    def stop_profile(self) -> list[str]:
        """Stop profiling and write one trace per worker; returns their paths.
        Raises :class:`ProfilingError` when not profiling."""
        self._check_alive()
        if self.config.profile_dir is None:
            raise ProfilingError("profiling is off: set EngineConfig(profile_dir=...)")
        return self.executor.stop_profile()

    def snapshot(self) -> EngineSnapshot:
        """Per-request state held by the scheduler and the runner (an executor holds none)."""
        alive = self._dead is None and not self._shut_down
        cached = self.collective_rpc("cached_request_ids", unique_reply_rank=0) if alive else []
        offloaded = (
            self.collective_rpc("offloaded_request_ids", unique_reply_rank=0)
            if alive and self.config.preempted_offload_bytes
            else []
        )
        return EngineSnapshot(
            scheduler_ids=frozenset(self.scheduler.requests),
            running_ids=frozenset(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            runner_cached_ids=frozenset(cached),
            unclaimed_stream_ids=frozenset(),
            runner_offloaded_ids=frozenset(offloaded),
        )

    def shutdown(self, reason: str = "the engine was shut down") -> list[RequestOutput]:
        """Abort every active request, let the workers drop their state, and stop
        the executor. Returns the final outputs of the requests it ended.
        Idempotent; a dead core only stops its executor."""
        if self._shut_down:
            return []
        self._shut_down = True
        outputs: list[RequestOutput] = []
        try:
            if self._dead is None:
                # Queued requests are admitted, so each ends with a lifecycle of its own.
                self._take_inbox(self._inbox.take_all())
                outputs += self._take_refused()
                self._deliveries.put(self._pending)
                self._deliveries.put(
                    self._final_output(ended, None)
                    for ended in self.scheduler.finish_all(Trigger.ABORT, reason)
                )
                self._pending = []
                outputs += self._interrupted_outputs + self._delivered(wait=True)
                self._interrupted_outputs = []
                self._release_everything_on_workers()
        finally:
            self.executor.shutdown()
            if self._dead is None:
                self._end_trace(EngineEvent("closed", time.monotonic()))
        return outputs

    # -- death ---------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._shut_down:
            raise EngineDeadError("the engine core was shut down")

    def _die(self, error: EngineDeadError) -> None:
        """Fail every request (their outputs are not returned: callers get ``error``)."""
        if self._dead is not None:
            return
        self._dead = error
        self._inbox.take_all()
        self._pending = []
        self._refused = []
        self._interrupted_outputs = []
        self._deliveries.clear()
        try:
            self.scheduler.finish_all(Trigger.FAIL, str(error))
        except Exception:  # the core is dying: report, never hide the cause
            logger.exception("a hook failed while the core's requests were failed")
        finally:
            self._end_trace(EngineEvent("dead", time.monotonic(), str(error)))

    def _release_everything_on_workers(self) -> None:
        """Let the workers drop the state of requests ended by shutdown (best effort)."""
        if self.executor.is_failed:
            return
        try:
            self._send_release()
        except EngineDeadError:
            logger.warning("the executor died while shutting down")

    def _send_release(self) -> None:
        """An output that runs nothing and only tells the workers which ids finished."""
        self._release_due = False
        release = self._trace_wave(self.scheduler.schedule_release())
        if release is not None:
            self._trace_runner(self._execute(release))

    # -- tracing -------------------------------------------------------------------------

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
        """Publish the core's last event, run the auditor's end checks, close the trace."""
        try:
            if self.machine.traced:
                self.machine.publish(event)
            if self.auditor is not None:
                try:
                    self.auditor.finish()
                except InvariantViolation:
                    logger.error("the engine ended with invariant violations")
        finally:
            if self._trace_writer is not None:
                self._trace_writer.close()

    def _trace_wave(self, output: SchedulerOutput | None) -> SchedulerOutput | None:
        if output is not None and self.machine.traced:
            # A wave's runner event is published only if its wave event was: a
            # subscriber that joins mid-wave never sees a result without its wave.
            self._traced_waves.add(output.wave_id)
            new_ids = tuple(r.request_id for r in output.scheduled_new_reqs)
            active = self.scheduler.requests
            keys, steps = [], []
            for rid in output.scheduled_cached_ids + new_ids:
                request = active.get(rid)
                keys.append(None if request is None else request.batch_key)
                steps.append(0 if request is None else request.params.num_inference_steps)
            self.machine.publish(
                WaveEvent(
                    output.wave_id,
                    new_ids,
                    output.scheduled_cached_ids,
                    output.finished_ids,
                    time.monotonic(),
                    batch_keys=tuple(keys),
                    num_steps=tuple(steps),
                    capacity=self.config.max_num_seqs,
                    mode=self.config.resolved_mode,
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
                    steps=tuple(result.progress.values()),
                    cached_steps=_cached_steps(result),
                )
            )

    def _cache_of(self, request: Request) -> CacheSettings | None:
        config = self.config
        return effective_cache(config.cache_backend, config.cache_config, request.params.cache)

    def _trace_delivery(self, request: Request, output: RequestOutput) -> None:
        images = output.image_batch
        self.machine.publish(
            DeliveryEvent(
                request.request_id,
                output.status,
                finished=output.finished,
                digest="" if images is None else images_digest(images),
                fingerprint=_fingerprint(request, self._cache_of(request)),
                time=time.monotonic(),
            )
        )


@attrs.frozen
class _Products:
    """What a completed request's final output carries from its last result: images,
    or latents when it asked for them, and its trajectory when it asked for one."""

    images: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    trajectory: Trajectory | None = None

    @classmethod
    def of(cls, request: Request, result: RunnerOutput | None) -> _Products:
        if result is None:
            return cls()
        request_id = request.request_id
        output = result.images.get(request_id)
        trajectory = _trajectory(result, request_id, end_step=None)
        if request.params.decodes:
            return cls(images=output, trajectory=trajectory)
        return cls(latents=output, trajectory=trajectory)


def _trajectory(result: RunnerOutput, request_id: str, end_step: int | None) -> Trajectory | None:
    """The trajectory a result holds for a request: the whole one (``end_step``
    ``None``), or the streamed part that ends before step ``end_step``."""
    latents = result.trajectory_latents.get(request_id)
    if latents is None:
        return None
    timesteps, log_prob_steps = result.trajectory_steps[request_id]
    return Trajectory(
        latents=latents,
        timesteps=timesteps,
        log_probs=result.trajectory_log_probs.get(request_id),
        log_prob_steps=log_prob_steps,
        first_step=0 if end_step is None else end_step - len(timesteps),
    )


def _metrics(request: Request, finished: float) -> RequestMetrics:
    scheduled = request.scheduled_time
    queue_s = (scheduled if scheduled is not None else finished) - request.arrival_time
    spent = request.stage_seconds
    peak = request.peak_memory_bytes
    return RequestMetrics(
        queue_time_s=queue_s,
        execution_time_s=0.0 if scheduled is None else finished - scheduled,
        total_time_s=finished - request.arrival_time,
        stage_durations={"queue": queue_s, **{s: spent.get(s, 0.0) for s in STAGES[1:]}},
        peak_memory_mb=None if peak is None else peak / 2**20,
        cached_steps=request.cached_steps,
        model_evaluations=request.model_evaluations,
    )


class _WaveInterrupted(Exception):
    """A KeyboardInterrupt stopped a wave; the wave's requests have failed."""


def _refused(queued: QueuedRequest, error: Exception) -> RequestOutput:
    """The final output of a queued request the scheduler would not admit."""
    return RequestOutput(
        request_id=queued.request_id,
        status=RequestStatus.FINISHED_ERROR,
        finished=True,
        image_batch=None,
        seed=queued.seed,
        error=describe_error(error),
    )


def _as_dead(exc: BaseException) -> EngineDeadError:
    if isinstance(exc, EngineDeadError):
        return exc
    if isinstance(exc, Exception):
        logger.exception("the engine core failed")
    return EngineDeadError(f"the engine core failed: {describe_error(exc)}")


def _cached_steps(result: RunnerOutput) -> tuple[tuple[str, int], ...]:
    """The ids whose steps in ``result`` reused a cached model output, with how many."""
    if result.costs is None:
        return ()
    return tuple((rid, cached) for rid, (_, cached) in result.costs.steps.items() if cached)


def _fingerprint(request: Request, cache: CacheSettings | None) -> str:
    """A fingerprint of everything a request's output may depend on (``cache``:
    the step cache it ran with)."""
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
        *(() if p.lora is None else (repr(p.lora),)),
        *(() if p.decodes else ("latent",)),
        *(() if p.custom_schedule is None else (p.custom_schedule,)),
        *(() if cache is None else (cache,)),
    )
    return hashlib.blake2b(repr(inputs).encode(), digest_size=12).hexdigest()
