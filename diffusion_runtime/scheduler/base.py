"""BaseScheduler: admission, the waiting queue, the running set, and waves."""

from __future__ import annotations

import abc
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import ClassVar, NamedTuple

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import NewRequestData, RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import DuplicateRequestError, QueueFullError
from diffusion_runtime.fsm import (
    DEADLINE_REASON,
    WAITING_STATES,
    Hook,
    LifecycleEvent,
    RequestMachine,
    RequestStatus,
    Trigger,
)
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.adapter_budget import AdapterBudget
from diffusion_runtime.scheduler.cost_meter import WaveCostMeter
from diffusion_runtime.scheduler.policies import SchedulingPolicy, resolve_policy_class
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.step_cost import StepCostModel


class Ended(NamedTuple):
    """A request that reached a terminal state, and the transition that ended it."""

    request: Request
    event: LifecycleEvent


class BaseScheduler(abc.ABC):
    """Owns every admitted request until its terminal transition.

    The scheduler decides *what* runs; it never assigns a state itself. It fires
    triggers on the request machine and keeps its own tables in step through
    the machine's hooks, so every path into a terminal state cleans up the same
    way. Its :class:`SchedulingPolicy` ranks requests; under ``fifo`` every
    operation is O(1) in the queue depth except a wave, which is O(wave size);
    a reordering policy ranks every active request at each wave (O(n log n)).
    """

    #: The execution mode whose runner this scheduler's outputs are meant for.
    execution_mode: ClassVar[str] = "request"
    #: Whether workers keep per-request state between outputs (step mode). Only
    #: then do finished ids travel in ``finished_ids``: in request mode a
    #: worker holds nothing once a wave is done, so nothing is sent to release.
    keeps_runner_state: ClassVar[bool] = False
    #: The time of the requests: it stamps each wave's scheduling for :attr:`cost_meter`
    #: and ``scheduled_time``/``finished_time``. The core sets it to its own clock, so
    #: it agrees with arrival times, deadlines and the ``now`` given to :meth:`schedule`.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, machine: RequestMachine[Request], config: EngineConfig) -> None:
        self.machine = machine
        self.max_num_running_reqs = config.max_num_seqs
        self.max_loras = config.max_loras
        self.max_waiting_requests = config.max_waiting_requests
        self.requests: dict[str, Request] = {}
        # An OrderedDict, not a deque: removal of any waiting request is O(1).
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._next_wave_id = 0
        self.step_costs = StepCostModel()
        #: Times the waves for :attr:`step_costs`; the core reports each wave's results to it.
        self.cost_meter = WaveCostMeter(self.step_costs, step_mode=self.keeps_runner_state)
        self.policy: SchedulingPolicy = resolve_policy_class(config.scheduling_policy)(
            self.step_costs
        )
        self.aging_s = config.scheduling_aging_s
        self.drops_late_requests = config.deadline_miss == "drop"
        #: How many times a running request was preempted.
        self.num_preemptions = 0
        # (deadline, order, request) of requests that may be dropped when it passes.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._admissions = itertools.count()
        machine.add_hook(Hook.SCHEDULED, self._on_scheduled)
        machine.add_hook(Hook.PREEMPTED, self._on_preempted)
        machine.add_hook(Hook.TERMINAL, self._on_terminal)

    # -- admission and control ----------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Admit ``request`` at the back of the waiting queue."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(
                f"request id {request.request_id!r} is already in use by an active request"
            )
        if self.max_waiting_requests is not None and len(self.waiting) >= self.max_waiting_requests:
            raise QueueFullError(
                f"waiting queue is full ({self.max_waiting_requests} requests); retry later"
            )
        request.order = next(self._admissions)
        finished_before = request.state.is_finished  # a reused request: admit refuses it
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request
        try:
            self.machine.admit(request)
        except BaseException:
            if request.state.is_finished and not finished_before:  # its terminal hook cleaned up
                raise
            del self.requests[request.request_id], self.waiting[request.request_id]
            raise
        self._watch_deadline(request)

    def batch_key_for(self, params: SamplingParams) -> Hashable:
        """Requests may share a wave only when their keys are equal."""
        return params.request_batch_key()

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def abort_request(self, request_id: str, reason: str) -> Ended | None:
        """Abort an active request; ``None`` when the id is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        event = self.machine.abort_if_active(request, reason)
        return None if event is None else Ended(request, event)

    def fail_request(self, request_id: str, reason: str, wave_id: int | None = None) -> Ended:
        request = self.requests[request_id]
        return Ended(
            request, self.machine.fire(request, Trigger.FAIL, wave_id=wave_id, reason=reason)
        )

    def preempt_request(self, request_id: str) -> None:
        """Move a running request back to the head of the waiting queue. In step
        mode the workers keep its state and it resumes where it stopped; in
        request mode it restarts from its first step."""
        self.machine.fire(self.requests[request_id], Trigger.PREEMPT)

    def expire_waiting(self, now: float) -> list[Ended]:
        """With ``deadline_miss="drop"``: abort (reason ``"deadline"``) every waiting
        or preempted request whose deadline is at or before ``now``."""
        ended = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            request = heapq.heappop(deadlines)[2]
            # A running request leaves the heap; it comes back if it is preempted.
            if request.state in WAITING_STATES:
                event = self.machine.fire(request, Trigger.ABORT, reason=DEADLINE_REASON)
                ended.append(Ended(request, event))
        return ended

    def finish_all(self, trigger: Trigger, reason: str) -> list[Ended]:
        """End every active request with ``trigger`` (abort on close, fail on death).

        Every request is ended even if a hook raises for one of them; the first
        error is re-raised at the end.
        """
        ended: list[Ended] = []
        first_error: BaseException | None = None
        for request in list(self.requests.values()):
            try:
                ended.append(Ended(request, self.machine.fire(request, trigger, reason=reason)))
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return ended

    # -- queries -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_release(self) -> bool:
        """Whether finished ids wait to be sent to the workers (so they drop their state)."""
        return bool(self._finished_ids)

    def next_wakeup(self) -> float | None:
        """The time (on :attr:`clock`) at which :meth:`schedule` may have new work,
        if it is waiting (here: the next deadline of a waiting or preempted request,
        which drops it). It sheds the deadlines of requests that ran or ended
        since they were watched (one preempted later is watched again)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state not in WAITING_STATES:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    # -- one tick ------------------------------------------------------------------

    @abc.abstractmethod
    def schedule(self, now: float) -> SchedulerOutput | None:
        """The next wave to run, or ``None`` when there is nothing to send."""

    @abc.abstractmethod
    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Ended]:
        """Apply a wave's results: finish, fail or advance each scheduled request.

        Returns the requests this update ended, in the order they ended.
        """

    # -- ranking ---------------------------------------------------------------------

    def is_aged(self, request: Request, now: float) -> bool:
        """Whether ``request`` has been in the engine for the aging bound."""
        return now - request.arrival_time >= self.aging_s

    def ranked(self, requests: Iterable[Request], now: float) -> list[Request]:
        """``requests`` best first: those in the engine for ``scheduling_aging_s``
        before every younger one, in admission order; the others in the policy's
        :meth:`~SchedulingPolicy.order`."""
        aged: list[Request] = []
        young: list[Request] = []
        for request in requests:
            (aged if self.is_aged(request, now) else young).append(request)
        aged.sort(key=lambda request: request.order)
        return [*aged, *self.policy.order(young, now, self.max_num_running_reqs)]

    def plan(self, now: float, *, may_preempt: bool) -> tuple[list[Request], list[Request]]:
        """``(running requests to preempt, waiting requests to schedule)`` for the next wave.

        Under a policy that does not reorder this is :meth:`next_wave`. Otherwise
        requests are grouped by batch key, each group holding its first requests
        in :meth:`ranked` order (up to ``max_num_seqs``); the group of an aged first
        request runs, else the one the policy's ``choose_batch`` picks, and
        requests of other keys are skipped, not waited for (head-of-line
        bypass). With ``may_preempt`` and a preemptive policy, running requests
        compete with waiting ones and those left out are preempted. Without
        preemption the running set keeps its key, except that once a request of
        another key has aged, only requests admitted before it may join, until
        the running set drains (so it cannot starve).
        """
        if not self.policy.reorders:
            return [], self.next_wave()
        if not self.waiting:  # the running set shares one key: nothing could replace it
            return [], []
        if may_preempt and self.policy.preemptive:
            chosen = self._choose_batch(
                self.ranked([*self.running.values(), *self.waiting.values()], now), now
            )
            chosen_ids = {r.request_id for r in chosen}
            preempt = [r for r in self.running.values() if r.request_id not in chosen_ids]
            return preempt, [r for r in chosen if r.request_id not in self.running]
        free = self.max_num_running_reqs - len(self.running)
        if free <= 0 or not self.waiting:
            return [], []
        waiting = self.ranked(self.waiting.values(), now)
        running = next(iter(self.running.values()), None)
        if running is None:
            return [], self._choose_batch(waiting, now)
        # Aged requests rank first, in admission order. One of another key may be
        # passed only by requests admitted before it, while the running set drains.
        aged = itertools.takewhile(lambda request: self.is_aged(request, now), waiting)
        blocked = next((r for r in aged if r.batch_key != running.batch_key), None)
        before = math.inf if blocked is None else blocked.order
        budget = AdapterBudget(self.max_loras, self.running.values())
        joining = [
            r
            for r in waiting
            if r.batch_key == running.batch_key and r.order < before and budget.admits(r)
        ]
        return [], joining[:free]

    def _choose_batch(self, ranked: list[Request], now: float) -> list[Request]:
        """The batch to run among ``ranked`` requests (best first)."""
        batches: dict[Hashable, list[Request]] = {}
        budgets: dict[Hashable, AdapterBudget] = {}
        for request in ranked:
            batch = batches.setdefault(request.batch_key, [])
            budget = budgets.setdefault(request.batch_key, AdapterBudget(self.max_loras))
            if len(batch) < self.max_num_running_reqs and budget.admits(request):
                batch.append(request)
        if not batches:
            return []
        ordered = list(batches.values())
        if self.is_aged(ranked[0], now):
            return ordered[0]
        return ordered[self.policy.choose_batch(ordered, now)]

    def next_wave(self) -> list[Request]:
        """The longest FIFO run of waiting requests that may join the running set.

        They share the batch key of the running requests (or of the head of
        the queue when nothing runs). Stops at the first incompatible request
        (head-of-line blocking is preferred to reordering) or at capacity
        (``max_num_seqs`` requests, ``max_loras`` distinct adapters).
        """
        capacity = self.max_num_running_reqs - len(self.running)
        wave: list[Request] = []
        if capacity <= 0 or not self.waiting:
            return wave
        running = next(iter(self.running.values()), None)
        head = running if running is not None else next(iter(self.waiting.values()))
        key: Hashable = head.batch_key
        budget = AdapterBudget(self.max_loras, self.running.values())
        for request in self.waiting.values():
            if request.batch_key != key or len(wave) >= capacity or not budget.admits(request):
                break
            wave.append(request)
        return wave

    def build_output(
        self,
        new: list[Request],
        cached_ids: tuple[str, ...] = (),
        resumed: tuple[Request, ...] = (),
    ) -> SchedulerOutput | None:
        """Fire ``schedule`` on ``resumed`` and ``new`` and build the output (``None``:
        nothing to say). ``resumed`` are preempted requests whose runner state the
        workers kept: their ids must be in ``cached_ids``, and no payload is sent."""
        if not new and not cached_ids and not self._finished_ids:
            return None
        wave_id = self._next_wave_id
        self._next_wave_id += 1
        schedule = self.machine.fire
        for request in (*resumed, *new):
            schedule(request, Trigger.SCHEDULE, wave_id=wave_id)
        cached = [self.requests[request_id] for request_id in cached_ids]
        self.cost_meter.wave_scheduled(
            wave_id, new, cached, starts=bool(new or resumed), now=self.clock()
        )
        finished_ids = tuple(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(
            wave_id=wave_id,
            scheduled_new_reqs=tuple(
                NewRequestData(r.request_id, r.prompt, r.params, r.seed) for r in new
            ),
            scheduled_cached_ids=cached_ids,
            finished_ids=finished_ids,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )

    def requeue_finished_ids(self, request_ids: tuple[str, ...]) -> None:
        """Report ids as finished again: the output that carried them failed."""
        self._finished_ids.extend(request_ids)

    def schedule_release(self) -> SchedulerOutput | None:
        """An output that runs nothing and only reports finished ids (so workers free state)."""
        return self.build_output([])

    # -- hooks: the scheduler's tables follow the machine ------------------------------

    def _on_scheduled(self, request: Request, event: LifecycleEvent) -> None:
        del self.waiting[request.request_id]
        self.running[request.request_id] = request
        if request.scheduled_time is None:
            request.scheduled_time = self.clock()

    def _on_preempted(self, request: Request, event: LifecycleEvent) -> None:
        del self.running[request.request_id]
        self.waiting[request.request_id] = request
        self.waiting.move_to_end(request.request_id, last=False)
        self.num_preemptions += 1
        self._watch_deadline(request)
        # Step mode: the workers keep its state and it resumes where it stopped.
        # Request mode: nothing was kept, so it starts over.
        if not self.keeps_runner_state:
            request.step_index, request.num_steps = 0, None

    def _watch_deadline(self, request: Request) -> None:
        if not self.drops_late_requests or request.deadline is None:
            return
        deadlines = self._deadlines
        if len(deadlines) > 2 * len(self.waiting) + 64:
            # Entries of requests that ran or ended wait for their deadline to pass:
            # shed them now and then, so the heap stays the size of the queue.
            deadlines[:] = [entry for entry in deadlines if entry[2].state in WAITING_STATES]
            heapq.heapify(deadlines)
        heapq.heappush(deadlines, (request.deadline, request.order, request))

    def _on_terminal(self, request: Request, event: LifecycleEvent) -> None:
        request_id = request.request_id
        del self.requests[request_id]
        if event.source is RequestStatus.RUNNING:
            del self.running[request_id]
        else:
            del self.waiting[request_id]
        request.finished_time = self.clock()
        if self.keeps_runner_state and request.scheduled_time is not None:  # workers saw it
            self._finished_ids.append(request_id)
