"""The request machine: the one place that decides a request's state.

Rule 1: every move a request can make is in :data:`TRANSITION_TABLE`. The
scheduler, the executor and the engine fire triggers and attach hooks; none of
them assigns a state. The table is data, so the docs diagram is generated from
it and cannot drift from the code.

One ``transitions.Machine`` serves every request of an engine. Requests are
plain slotted objects that the machine is never bound to (no ``add_model``),
and triggers are fired as ``machine.events[name].trigger(request)``: binding a
model costs time that grows with the number of live requests, firing an event
does not.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from transitions import Machine, MachineError

from diffusion_runtime.fsm.events import ADMIT, LifecycleEvent, TraceEvent
from diffusion_runtime.fsm.states import RequestStatus

WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
COMPLETED = RequestStatus.FINISHED_COMPLETED
ABORTED = RequestStatus.FINISHED_ABORTED
ERROR = RequestStatus.FINISHED_ERROR


class Trigger(str, enum.Enum):
    """The names of the machine's triggers."""

    SCHEDULE = "schedule"
    PREEMPT = "preempt"
    COMPLETE = "complete"
    ABORT = "abort"
    FAIL = "fail"


class Hook(str, enum.Enum):
    """The points where components attach work to the lifecycle."""

    ADMITTED = "admitted"
    SCHEDULED = "scheduled"
    PREEMPTED = "preempted"
    TERMINAL = "terminal"


#: Every legal move: ``trigger -> (sources, dest)``. Anything not here is illegal.
TRANSITION_TABLE: dict[Trigger, tuple[tuple[RequestStatus, ...], RequestStatus]] = {
    Trigger.SCHEDULE: ((WAITING, PREEMPTED), RUNNING),
    Trigger.PREEMPT: ((RUNNING,), PREEMPTED),
    Trigger.COMPLETE: ((RUNNING,), COMPLETED),
    Trigger.ABORT: ((WAITING, RUNNING, PREEMPTED), ABORTED),
    Trigger.FAIL: ((WAITING, RUNNING, PREEMPTED), ERROR),
}

#: The hook group that runs when a request enters each state.
ENTRY_HOOKS: dict[RequestStatus, Hook] = {
    WAITING: Hook.ADMITTED,
    RUNNING: Hook.SCHEDULED,
    PREEMPTED: Hook.PREEMPTED,
    COMPLETED: Hook.TERMINAL,
    ABORTED: Hook.TERMINAL,
    ERROR: Hook.TERMINAL,
}

INITIAL_STATE = WAITING


class LifecycleViolation(RuntimeError):
    """A component fired a trigger the machine does not allow from the current state."""

    def __init__(self, request_id: str, state: RequestStatus, trigger: str) -> None:
        self.request_id = request_id
        self.state = state
        self.trigger = trigger
        super().__init__(
            f"request {request_id!r}: trigger {trigger!r} is not allowed in state {state.value}"
        )


class RequestLifecycle:
    """The part of a request the machine reads and writes.

    Components subclass it to carry their own per-request fields; the machine
    only touches ``state``.
    """

    __slots__ = ("request_id", "state")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.state = INITIAL_STATE

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished


L = TypeVar("L", bound=RequestLifecycle)
LifecycleHook = Callable[[L, LifecycleEvent], None]
EventSubscriber = Callable[[TraceEvent], None]


class RequestMachine(Generic[L]):
    """Fires triggers on requests, emits a :class:`LifecycleEvent` per transition,
    and runs the hooks attached to the state entered.

    Hooks run in registration order. Every hook of a group runs even when an
    earlier one raises; the first error is re-raised afterwards, so a failing
    cleanup hook never hides the others' work.
    """

    def __init__(self) -> None:
        self._hooks: dict[Hook, list[LifecycleHook[L]]] = {hook: [] for hook in Hook}
        self._subscribers: list[EventSubscriber] = []
        # The event of the transition being fired (a machine serves one thread at a time).
        self._last_event = LifecycleEvent("", None, INITIAL_STATE, ADMIT, None, 0.0)
        self._machine = Machine(
            model=None,
            states=RequestStatus,
            initial=INITIAL_STATE,
            transitions=[
                {"trigger": trigger.value, "source": list(sources), "dest": dest}
                for trigger, (sources, dest) in TRANSITION_TABLE.items()
            ],
            auto_transitions=False,
            send_event=True,
            after_state_change=[self._after_transition],
        )
        self._events = {trigger: self._machine.events[trigger.value] for trigger in Trigger}

    # -- attaching ---------------------------------------------------------------

    def add_hook(self, hook: Hook, fn: LifecycleHook[L]) -> None:
        """Run ``fn(request, event)`` whenever a request enters a state of group ``hook``."""
        self._hooks[hook].append(fn)

    def subscribe(self, fn: EventSubscriber) -> None:
        """Send every event to ``fn``: transitions (including rejected triggers)
        and what components :meth:`publish`."""
        self._subscribers.append(fn)

    def unsubscribe(self, fn: EventSubscriber) -> None:
        self._subscribers.remove(fn)

    @property
    def traced(self) -> bool:
        """Whether anyone listens; components skip building events when not."""
        return bool(self._subscribers)

    def publish(self, event: TraceEvent) -> None:
        """Send a component's event (a wave, a runner result, a delivery) to subscribers."""
        for fn in self._subscribers:
            fn(event)

    # -- firing ------------------------------------------------------------------

    def admit(self, request: L) -> None:
        """Record a new request's entry into the machine, in the initial state."""
        if request.state is not INITIAL_STATE:
            raise LifecycleViolation(request.request_id, request.state, ADMIT)
        event = LifecycleEvent(
            request.request_id, None, INITIAL_STATE, ADMIT, None, time.monotonic()
        )
        self._dispatch(request, event)

    def fire(
        self, request: L, trigger: Trigger, *, wave_id: int | None = None, reason: str | None = None
    ) -> LifecycleEvent:
        """Move ``request`` by ``trigger`` and return the transition's event, or
        raise :class:`LifecycleViolation`.

        A rejected trigger leaves the state unchanged and is still published to
        subscribers (as an event with ``rejected=True``), so a trace shows it.
        """
        try:
            self._events[trigger].trigger(request, wave_id=wave_id, reason=reason)
        except MachineError:
            state = request.state
            self.publish(
                LifecycleEvent(
                    request.request_id,
                    state,
                    state,
                    trigger.value,
                    wave_id,
                    time.monotonic(),
                    reason,
                    rejected=True,
                )
            )
            raise LifecycleViolation(request.request_id, state, trigger.value) from None
        return self._last_event

    def abort_if_active(self, request: L, reason: str) -> LifecycleEvent | None:
        """A caller's abort: a no-op (returning ``None``) once the request has finished.

        A caller racing a request's completion is normal, not a violation.
        """
        if request.state.is_finished:
            return None
        return self.fire(request, Trigger.ABORT, reason=reason)

    def legal_moves(self) -> list[tuple[RequestStatus, Trigger, RequestStatus]]:
        """``(source, trigger, dest)`` for every transition, read back from the
        ``transitions`` machine itself (the docs diagram is drawn from this)."""
        return [
            (RequestStatus[source], Trigger(name), RequestStatus[str(transition.dest)])
            for name, event in self._machine.events.items()
            for source, transitions in event.transitions.items()
            for transition in transitions
        ]

    def can_fire(self, request: L, trigger: Trigger) -> bool:
        return request.state in TRANSITION_TABLE[trigger][0]

    # -- internals ---------------------------------------------------------------

    def _after_transition(self, event_data: Any) -> None:
        kwargs = event_data.kwargs
        event = LifecycleEvent(
            event_data.model.request_id,
            RequestStatus[event_data.transition.source],
            RequestStatus[event_data.transition.dest],
            event_data.event.name,
            kwargs["wave_id"],
            time.monotonic(),
            kwargs["reason"],
        )
        self._last_event = event
        self._dispatch(event_data.model, event)

    def _dispatch(self, request: L, event: LifecycleEvent) -> None:
        first_error: BaseException | None = None
        try:
            self.publish(event)
        except BaseException as exc:
            first_error = exc
        for fn in self._hooks[ENTRY_HOOKS[event.dest]]:
            try:
                fn(request, event)
            except BaseException as exc:
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error
