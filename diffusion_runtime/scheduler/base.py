"""BaseScheduler: admission, the waiting queue, the running set, and waves."""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Hashable
from typing import ClassVar, NamedTuple

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import NewRequestData, RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import DuplicateRequestError, QueueFullError
from diffusion_runtime.fsm import Hook, LifecycleEvent, RequestMachine, RequestStatus, Trigger
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.request import Request


class Ended(NamedTuple):
    """A request that reached a terminal state, and the transition that ended it."""

    request: Request
    event: LifecycleEvent


class BaseScheduler(abc.ABC):
    """Owns every admitted request until its terminal transition.

    The scheduler decides *what* runs; it never assigns a state itself. It fires
    triggers on the request machine and keeps its own tables in step through
    the machine's hooks, so every path into a terminal state cleans up the same
    way. All operations are O(1) in the queue depth, except a wave, which is
    O(wave size).
    """

    #: The execution mode whose runner this scheduler's outputs are meant for.
    execution_mode: ClassVar[str] = "request"
    #: Whether workers keep per-request state between outputs (step mode). Only
    #: then do finished ids travel in ``finished_ids``: in request mode a
    #: worker holds nothing once a wave is done, so nothing is sent to release.
    keeps_runner_state: ClassVar[bool] = False

    def __init__(self, machine: RequestMachine[Request], config: EngineConfig) -> None:
        self.machine = machine
        self.max_num_running_reqs = config.max_num_seqs
        self.max_waiting_requests = config.max_waiting_requests
        self.requests: dict[str, Request] = {}
        # An OrderedDict, not a deque: removal of any waiting request is O(1).
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._next_wave_id = 0
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
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request
        try:
            self.machine.admit(request)
        except BaseException:
            if request.state.is_finished:  # its terminal hook already cleaned up
                raise
            del self.requests[request.request_id], self.waiting[request.request_id]
            raise

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
        """Move a running request back to the head of the waiting queue; it
        restarts from its first step when scheduled again."""
        self.machine.fire(self.requests[request_id], Trigger.PREEMPT)

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
        """The monotonic time at which :meth:`schedule` may have new work, if it is waiting."""
        return None

    # -- one tick ------------------------------------------------------------------

    @abc.abstractmethod
    def schedule(self, now: float) -> SchedulerOutput | None:
        """The next wave to run, or ``None`` when there is nothing to send."""

    @abc.abstractmethod
    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Ended]:
        """Apply a wave's results: finish, fail or advance each scheduled request.

        Returns the requests this update ended, in the order they ended.
        """

    def next_wave(self) -> list[Request]:
        """The longest FIFO run of waiting requests that may join the running set.

        They share the batch key of the running requests (or of the head of
        the queue when nothing runs). Stops at the first incompatible request
        (head-of-line blocking is preferred to reordering) or at capacity.
        """
        capacity = self.max_num_running_reqs - len(self.running)
        wave: list[Request] = []
        if capacity <= 0 or not self.waiting:
            return wave
        running = next(iter(self.running.values()), None)
        head = running if running is not None else next(iter(self.waiting.values()))
        key: Hashable = head.batch_key
        for request in self.waiting.values():
            if request.batch_key != key or len(wave) >= capacity:
                break
            wave.append(request)
        return wave

    def build_output(
        self, new: list[Request], cached_ids: tuple[str, ...] = ()
    ) -> SchedulerOutput | None:
        """Fire ``schedule`` on ``new`` and build the output (``None``: nothing to say)."""
        if not new and not cached_ids and not self._finished_ids:
            return None
        wave_id = self._next_wave_id
        self._next_wave_id += 1
        schedule = self.machine.fire
        for request in new:
            schedule(request, Trigger.SCHEDULE, wave_id=wave_id)
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
            request.scheduled_time = event.time

    def _on_preempted(self, request: Request, event: LifecycleEvent) -> None:
        del self.running[request.request_id]
        self.waiting[request.request_id] = request
        self.waiting.move_to_end(request.request_id, last=False)
        # It starts over when scheduled again: the workers drop what they hold for it.
        if self.keeps_runner_state:
            self._finished_ids.append(request.request_id)
        request.step_index, request.num_steps = 0, None

    def _on_terminal(self, request: Request, event: LifecycleEvent) -> None:
        request_id = request.request_id
        del self.requests[request_id]
        if event.source is RequestStatus.RUNNING:
            del self.running[request_id]
        else:
            del self.waiting[request_id]
        request.finished_time = event.time
        if self.keeps_runner_state and request.scheduled_time is not None:  # workers saw it
            self._finished_ids.append(request_id)
