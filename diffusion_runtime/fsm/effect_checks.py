"""Checkers of policy and effect: what a wave may hold, and that aborts, step
counts, output flags and deadline drops do what they say (INV-007..011).

INV-001..006 check that the runtime's records agree with each other; these
check that the records agree with what was asked for: the engine's capacity,
a request's step count, a caller's abort.
"""

from __future__ import annotations

from diffusion_runtime.fsm.events import (
    ADMIT,
    AbortEvent,
    DeliveryEvent,
    EngineEvent,
    LifecycleEvent,
    RunnerEvent,
    TraceEvent,
    WaveEvent,
)
from diffusion_runtime.fsm.states import (
    DEADLINE_REASON,
    TERMINAL_STATES,
    WAITING_STATES,
    RequestStatus,
)
from diffusion_runtime.fsm.violation import Recent, Violation


class WavesFollowPolicy:
    """A wave holds at most ``max_num_seqs`` requests, all with one compatibility
    key; in request mode, all with one step count."""

    invariant = "INV-007"
    rule = "a wave holds at most max_num_seqs requests, sharing one compatibility key"
    events = (WaveEvent,)

    def feed(self, event: TraceEvent) -> list[Violation]:
        if not isinstance(event, WaveEvent):
            return []
        problems = []
        size = len(event.scheduled_ids)
        if event.capacity and size > event.capacity:
            problems.append(
                f"wave {event.wave_id} holds {size} requests; max_num_seqs is {event.capacity}"
            )
        keys = set(event.batch_keys)
        if len(keys) > 1:
            shown = sorted(k if isinstance(k, str) else repr(k) for k in keys)
            problems.append(f"wave {event.wave_id} mixes compatibility keys {shown}")
        steps = set(event.num_steps)
        if event.mode == "request" and len(steps) > 1:
            problems.append(f"request-mode wave {event.wave_id} mixes step counts {sorted(steps)}")
        return [Violation(self.invariant, None, message, (event,)) for message in problems]

    def finish(self, complete: bool) -> list[Violation]:
        return []


class AbortsTakeEffect:
    """An abort of an active request ends it ``FINISHED_ABORTED`` before the next
    wave is scheduled: by the next step boundary in step mode, at the end of
    the current wave in request mode."""

    invariant = "INV-008"
    rule = "an abort of an active request ends it ABORTED before the next wave starts"
    events = (LifecycleEvent, AbortEvent, WaveEvent, EngineEvent)

    def __init__(self) -> None:
        self.states: Recent[str, RequestStatus] = Recent()
        self.pending: dict[str, AbortEvent] = {}

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, LifecycleEvent):
            return self._lifecycle(event)
        if isinstance(event, AbortEvent):
            state = self.states.get(event.request_id)
            if state is not None and state not in TERMINAL_STATES:
                self.pending.setdefault(event.request_id, event)
            return []
        if isinstance(event, WaveEvent) and self.pending:
            late, self.pending = self.pending, {}
            return [
                Violation(
                    self.invariant,
                    rid,
                    f"still active when wave {event.wave_id} was scheduled after its abort",
                    (abort, event),
                )
                for rid, abort in late.items()
            ]
        if isinstance(event, EngineEvent) and event.state == "dead":
            self.pending.clear()  # death fails everything: INV-001 checks the ends
        return []

    def _lifecycle(self, event: LifecycleEvent) -> list[Violation]:
        if event.rejected:
            return []
        rid = event.request_id
        self.states[rid] = event.dest
        if event.trigger == ADMIT:
            self.pending.pop(rid, None)
            return []
        abort = self.pending.pop(rid, None) if event.dest in TERMINAL_STATES else None
        if abort is None or event.dest is RequestStatus.FINISHED_ABORTED:
            return []
        return [
            Violation(
                self.invariant, rid, f"aborted while active, but ended {event.dest}", (abort, event)
            )
        ]

    def finish(self, complete: bool) -> list[Violation]:
        if not complete:
            return []
        return [
            Violation(self.invariant, rid, "aborted while active, but never ended", (abort,))
            for rid, abort in self.pending.items()
        ]


class StepsAsRequested:
    """In step mode a request advances one step at a time, toward the step count
    it asked for, and completes only after exactly that many steps."""

    invariant = "INV-009"
    rule = "a completed request ran exactly its requested number of denoising steps"
    events = (WaveEvent, RunnerEvent, LifecycleEvent)

    def __init__(self) -> None:
        self.requested: dict[str, int] = {}
        self.step_mode: set[str] = set()
        self.done: dict[str, tuple[int, RunnerEvent | None]] = {}

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, WaveEvent):
            new_steps = event.num_steps[len(event.cached_ids) :]  # scheduled: cached, then new
            for rid, steps in zip(event.new_ids, new_steps, strict=False):
                self.requested[rid] = steps
                self.done[rid] = (0, None)
                if event.mode == "step":
                    self.step_mode.add(rid)
            return []
        if isinstance(event, RunnerEvent):
            return self._runner(event)
        if isinstance(event, LifecycleEvent) and not event.rejected:
            return self._lifecycle(event)
        return []

    def _runner(self, event: RunnerEvent) -> list[Violation]:
        problems = []
        for rid, (step, total) in zip(event.progressed, event.steps, strict=False):
            requested = self.requested.get(rid)
            if requested is None:
                continue
            previous, _ = self.done.get(rid, (0, None))
            if total != requested or step != previous + 1:
                problems.append(
                    Violation(
                        self.invariant,
                        rid,
                        f"reported step {step} of {total} after step {previous}; "
                        f"it asked for {requested} steps",
                        (event,),
                    )
                )
            self.done[rid] = (step, event)
        return problems

    def _lifecycle(self, event: LifecycleEvent) -> list[Violation]:
        rid = event.request_id
        # A preempted request keeps its state and resumes at its next step (INV-006).
        if event.dest not in TERMINAL_STATES:
            return []
        requested = self.requested.pop(rid, None)
        step, runner = self.done.pop(rid, (0, None))
        in_step_mode = rid in self.step_mode
        self.step_mode.discard(rid)
        if event.dest is not RequestStatus.FINISHED_COMPLETED or not in_step_mode:
            return []
        if requested is None or step == requested:
            return []
        evidence = (event,) if runner is None else (runner, event)
        return [
            Violation(
                self.invariant,
                rid,
                f"completed after {step} of its {requested} requested steps",
                evidence,
            )
        ]

    def finish(self, complete: bool) -> list[Violation]:
        return []


class OutputsSayWhetherFinal:
    """An output is final exactly when its status is terminal: a progress output
    (``RUNNING``) is never final, and a final one never says ``RUNNING``."""

    invariant = "INV-010"
    rule = "progress outputs are never final, and final outputs carry a terminal status"
    events = (DeliveryEvent,)

    def feed(self, event: TraceEvent) -> list[Violation]:
        if not isinstance(event, DeliveryEvent):
            return []
        if event.finished == (event.status in TERMINAL_STATES):
            return []
        kind = "a final output" if event.finished else "a progress output"
        return [
            Violation(
                self.invariant, event.request_id, f"{kind} with status {event.status}", (event,)
            )
        ]

    def finish(self, complete: bool) -> list[Violation]:
        return []


class DeadlineDropsOnlyWaiting:
    """A request is dropped for its deadline only while it waits (``WAITING`` or
    ``PREEMPTED``): one that runs when its deadline passes runs on.

    Whether the deadline had passed is not checked here: deadlines live on the
    core's clock and event times on the real one, so the two are never compared.
    The deterministic harness checks it on its virtual clock.
    """

    invariant = "INV-011"
    rule = "a request is aborted for its deadline only while WAITING or PREEMPTED"
    events = (LifecycleEvent,)

    def feed(self, event: TraceEvent) -> list[Violation]:
        if not (
            isinstance(event, LifecycleEvent)
            and event.reason == DEADLINE_REASON
            and event.dest is RequestStatus.FINISHED_ABORTED
            and not event.rejected
            and event.source not in WAITING_STATES
        ):
            return []
        return [
            Violation(
                self.invariant,
                event.request_id,
                f"dropped for its deadline while {event.source}",
                (event,),
            )
        ]

    def finish(self, complete: bool) -> list[Violation]:
        return []
