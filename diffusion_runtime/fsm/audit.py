"""The invariant auditor: checks INV-001..015 over a stream of trace events.

Each invariant is a small checker with two methods: ``feed(event)`` returns the
violations an event reveals, and ``finish(complete)`` those only visible at the
end of a trace (``complete`` is True when the trace ends with the engine
closing cleanly). An :class:`Auditor` runs a set of checkers, online (as an
engine's event subscriber) or offline (over a trace file). Adding an invariant
is adding a checker; see ``docs/auditing.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import attrs

from diffusion_runtime.fsm.adapter_checks import (
    AdaptersInUseStay,
    AdaptersWithinLimits,
    PinnedAdaptersStay,
)
from diffusion_runtime.fsm.effect_checks import (
    AbortsTakeEffect,
    DeadlineDropsOnlyWaiting,
    OutputsSayWhetherFinal,
    StepsAsRequested,
    WavesFollowPolicy,
)
from diffusion_runtime.fsm.events import (
    ADMIT,
    AbortEvent,
    AdapterEvent,
    DeliveryEvent,
    EngineEvent,
    LifecycleEvent,
    ResourceEvent,
    RunnerEvent,
    TraceEvent,
    WaveEvent,
)
from diffusion_runtime.fsm.sleep_check import NothingRunsAsleep
from diffusion_runtime.fsm.states import TERMINAL_STATES, RequestStatus
from diffusion_runtime.fsm.violation import RECENT_LIMIT, InvariantViolation, Recent, Violation

__all__ = [
    "RECENT_LIMIT",
    "Auditor",
    "InvariantChecker",
    "InvariantViolation",
    "Recent",
    "Violation",
    "audit_events",
    "default_checkers",
]


class InvariantChecker(Protocol):
    """One invariant. ``invariant`` is its id, ``rule`` one sentence saying it.

    A checker may also declare ``events``, a tuple of the event classes it
    reads: the auditor then feeds it only those (without it, every event).
    """

    invariant: str
    rule: str

    def feed(self, event: TraceEvent) -> list[Violation]: ...

    def finish(self, complete: bool) -> list[Violation]: ...


class OneLifecycleOwner:
    """Each admitted request id has one lifecycle, from admission to exactly one
    terminal state, and no component ever attempts an illegal transition."""

    invariant = "INV-001"
    rule = (
        "each admitted request id has exactly one lifecycle, ending in exactly one terminal state"
    )
    events = (LifecycleEvent,)

    def __init__(self) -> None:
        self.open: dict[str, LifecycleEvent] = {}
        self.closed: Recent[str, LifecycleEvent] = Recent()

    def feed(self, event: TraceEvent) -> list[Violation]:
        if not isinstance(event, LifecycleEvent):
            return []
        rid = event.request_id
        if event.rejected:
            return [
                self._violation(
                    rid, f"a component attempted {event.trigger!r} in {event.dest}", event
                )
            ]
        if event.trigger == ADMIT:
            previous = self.open.get(rid)
            self.closed.pop(rid, None)
            self.open[rid] = event
            if previous is not None:
                return [
                    self._violation(
                        rid, "admitted while its lifecycle is still open", previous, event
                    )
                ]
            return []
        last = self.open.get(rid)
        if last is None:
            ended = self.closed.get(rid)
            message = (
                "transition after its terminal state" if ended else "transition without admission"
            )
            return [self._violation(rid, message, *(e for e in (ended, event) if e is not None))]
        problems = []
        if event.source is not last.dest:
            problems.append(
                self._violation(
                    rid, f"moved from {event.source} but was in {last.dest}", last, event
                )
            )
        if event.dest in TERMINAL_STATES:
            del self.open[rid]
            self.closed[rid] = event
        else:
            self.open[rid] = event
        return problems

    def finish(self, complete: bool) -> list[Violation]:
        if not complete:
            return []
        return [
            self._violation(rid, f"never reached a terminal state (last: {last.dest})", last)
            for rid, last in self.open.items()
        ]

    def state_of(self, request_id: str) -> RequestStatus | None:
        last = self.open.get(request_id) or self.closed.get(request_id)
        return None if last is None else last.dest

    def _violation(self, rid: str, message: str, *events: TraceEvent) -> Violation:
        return Violation(self.invariant, rid, message, events)


class ExecutionFollowsScheduler:
    """Workers run exactly the ids of each scheduler output, in its order, and
    nothing for an output the scheduler never emitted."""

    invariant = "INV-002"
    rule = "executors and workers run exactly the ids the scheduler emitted, in its order"
    events = (WaveEvent, RunnerEvent)

    def __init__(self) -> None:
        self.waves: dict[int, WaveEvent] = {}

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, WaveEvent):
            self.waves[event.wave_id] = event
            return []
        if not isinstance(event, RunnerEvent):
            return []
        wave = self.waves.pop(event.wave_id, None)
        if wave is None:
            return [
                Violation(
                    self.invariant,
                    None,
                    f"ran wave {event.wave_id}, which was never scheduled",
                    (event,),
                )
            ]
        scheduled = wave.scheduled_ids
        executed = event.executed
        if executed == scheduled:  # the common case, in O(n)
            return []
        problems = []
        scheduled_set = set(scheduled)
        extra = [rid for rid in executed if rid not in scheduled_set]
        for rid in extra:
            problems.append(
                Violation(
                    self.invariant,
                    rid,
                    f"executed in wave {wave.wave_id} without being scheduled",
                    (wave, event),
                )
            )
        accounted = {*executed, *event.failed}
        skipped = [rid for rid in scheduled if rid not in accounted]
        for rid in skipped:
            problems.append(
                Violation(
                    self.invariant,
                    rid,
                    f"scheduled in wave {wave.wave_id} but neither run nor failed",
                    (wave, event),
                )
            )
        executed_set = set(executed)
        ran_in_order = [rid for rid in scheduled if rid in executed_set]
        if not extra and list(executed) != ran_in_order:
            problems.append(
                Violation(
                    self.invariant,
                    None,
                    f"wave {wave.wave_id} ran in another order than scheduled",
                    (wave, event),
                )
            )
        return problems

    def finish(self, complete: bool) -> list[Violation]:
        if not complete:
            return []
        return [
            Violation(self.invariant, None, f"wave {wid} was scheduled but never ran", (wave,))
            for wid, wave in self.waves.items()
        ]


class TerminalCleanup:
    """After a terminal state nothing is left: runner state is released by the
    end of the next output, resources are freed, no work or output follows
    except the one final delivery."""

    invariant = "INV-003"
    rule = "every terminal path releases runner state, resources and the stream entry"

    def __init__(self) -> None:
        self.terminal: Recent[str, LifecycleEvent] = Recent()
        self.held: dict[str, RunnerEvent] = {}
        self.resources: dict[tuple[str, str], ResourceEvent] = {}
        self.delivered: Recent[str, None] = Recent()
        self.due_by_wave: dict[int, set[str]] = {}

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, LifecycleEvent) and not event.rejected:
            if event.trigger == ADMIT:
                self.terminal.pop(event.request_id, None)
                self.delivered.pop(event.request_id, None)
            elif event.dest in TERMINAL_STATES:
                self.terminal[event.request_id] = event
            return []
        if isinstance(event, WaveEvent):
            # Ids already terminal when this output was made must be gone once it has run.
            self.due_by_wave[event.wave_id] = self.held.keys() & self.terminal.keys()
            return []
        if isinstance(event, RunnerEvent):
            return self._runner(event)
        if isinstance(event, ResourceEvent):
            return self._resource(event)
        if isinstance(event, DeliveryEvent):
            return self._delivery(event)
        if isinstance(event, EngineEvent) and event.state == "dead":
            # The workers' state died with them or went with the executor's shutdown.
            self.held.clear()
            self.resources.clear()
        return []

    def _runner(self, event: RunnerEvent) -> list[Violation]:
        problems = []
        # Set operations in C first: almost every step has nothing to report.
        ran_after_end = self.terminal.keys() & event.executed
        for rid in event.executed if ran_after_end else ():
            ended = self.terminal.get(rid)
            if ended is not None and ended.time < event.time and rid not in event.failed:
                problems.append(
                    self._violation(
                        rid, "the runner worked on it after its terminal state", ended, event
                    )
                )
        for rid in event.created:
            self.held[rid] = event
        for rid in event.released:
            self.held.pop(rid, None)
        for rid in self.due_by_wave.pop(event.wave_id, set()):
            if rid in self.held:
                problems.append(
                    self._violation(
                        rid,
                        "runner state outlived the first output after its terminal state",
                        self.terminal[rid],
                        event,
                    )
                )
        return problems

    def _resource(self, event: ResourceEvent) -> list[Violation]:
        key = (event.request_id, event.resource)
        if event.acquired:
            self.resources[key] = event
            ended = self.terminal.get(event.request_id)
            if ended is not None:
                return [
                    self._violation(
                        event.request_id,
                        f"{event.resource} taken after its terminal state",
                        ended,
                        event,
                    )
                ]
        else:
            self.resources.pop(key, None)
        return []

    def _delivery(self, event: DeliveryEvent) -> list[Violation]:
        rid = event.request_id
        ended = self.terminal.get(rid)
        if not event.finished:
            if ended is not None:
                return [
                    self._violation(
                        rid, "an intermediate output after its terminal state", ended, event
                    )
                ]
            return []
        if rid in self.delivered:
            return [self._violation(rid, "a second final output", event)]
        self.delivered[rid] = None
        if ended is None:
            return [self._violation(rid, "a final output before any terminal state", event)]
        return []

    def finish(self, complete: bool) -> list[Violation]:
        problems = [
            self._violation(rid, "runner state never released", self.terminal[rid], created)
            for rid, created in self.held.items()
            if rid in self.terminal or complete
        ]
        problems += [
            self._violation(rid, f"{resource} never released", taken)
            for (rid, resource), taken in self.resources.items()
            if rid in self.terminal or complete
        ]
        if complete:
            problems += [
                self._violation(rid, "terminal, but the core emitted no final output", ended)
                for rid, ended in self.terminal.items()
                if rid not in self.delivered
            ]
        return problems

    def _violation(self, rid: str, message: str, *events: TraceEvent) -> Violation:
        return Violation(self.invariant, rid, message, events)


class HooksNotLifecycles:
    """Components act on a request only inside its one lifecycle: nothing is
    scheduled that is not running, and no output goes to an id never admitted."""

    invariant = "INV-004"
    rule = "optional features and components attach at the lifecycle's hooks, never beside it"
    events = (LifecycleEvent, WaveEvent, DeliveryEvent)

    def __init__(self) -> None:
        self.states: Recent[str, RequestStatus] = Recent()
        self.running: set[str] = set()

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, LifecycleEvent):
            if not event.rejected:
                self.states[event.request_id] = event.dest
                if event.dest is RequestStatus.RUNNING:
                    self.running.add(event.request_id)
                else:
                    self.running.discard(event.request_id)
            return []
        if isinstance(event, WaveEvent):
            if self.running.issuperset(event.scheduled_ids):
                return []
            return [
                Violation(
                    self.invariant,
                    rid,
                    f"in wave {event.wave_id} while {self.states.get(rid, 'never admitted')}",
                    (event,),
                )
                for rid in event.scheduled_ids
                if self.states.get(rid) is not RequestStatus.RUNNING
            ]
        if isinstance(event, DeliveryEvent) and event.request_id not in self.states:
            return [
                Violation(
                    self.invariant,
                    event.request_id,
                    "an output for an id that was never admitted",
                    (event,),
                )
            ]
        return []

    def finish(self, complete: bool) -> list[Violation]:
        return []


class ResultsKeepIdentity:
    """Results are mapped by request id: a worker reports results only for ids it
    ran, each id gets the status its lifecycle ended in, and equal inputs give
    equal outputs whatever their batch mates."""

    invariant = "INV-005"
    rule = "every result stays with its request id, independent of batch composition"
    events = (LifecycleEvent, RunnerEvent, DeliveryEvent)

    def __init__(self) -> None:
        self.digests: Recent[str, DeliveryEvent] = Recent()
        self.terminal: Recent[str, RequestStatus] = Recent()
        self.last_runner: RunnerEvent | None = None

    def feed(self, event: TraceEvent) -> list[Violation]:
        if (
            isinstance(event, LifecycleEvent)
            and event.dest in TERMINAL_STATES
            and not event.rejected
        ):
            self.terminal[event.request_id] = event.dest
            return self._completion_has_a_result(event)
        if isinstance(event, RunnerEvent):
            self.last_runner = event  # completions in a wave follow that wave's runner event
            ran = set(event.executed)
            if ran.issuperset(event.produced) and ran.issuperset(event.progressed):
                return []
            return [
                Violation(
                    self.invariant,
                    rid,
                    f"a result in wave {event.wave_id} for an id the runner did not run",
                    (event,),
                )
                for rid in (*event.produced, *event.progressed)
                if rid not in ran
            ]
        if not isinstance(event, DeliveryEvent) or not event.finished:
            return []
        problems = []
        ended = self.terminal.get(event.request_id)
        if ended is not None and ended is not event.status:
            problems.append(
                Violation(
                    self.invariant,
                    event.request_id,
                    f"delivered as {event.status} but ended {ended}",
                    (event,),
                )
            )
        if event.status is RequestStatus.FINISHED_COMPLETED and event.fingerprint:
            first = self.digests.setdefault(event.fingerprint, event)
            if first.digest != event.digest:
                problems.append(
                    Violation(
                        self.invariant,
                        event.request_id,
                        f"same inputs as {first.request_id!r} but a different output",
                        (first, event),
                    )
                )
        return problems

    def _completion_has_a_result(self, event: LifecycleEvent) -> list[Violation]:
        """A request completes only on images the runner produced for its id in that wave."""
        if event.dest is not RequestStatus.FINISHED_COMPLETED:
            return []
        runner = self.last_runner
        wave_matches = runner is not None and runner.wave_id == event.wave_id
        if wave_matches and runner is not None and event.request_id in runner.produced:
            return []
        evidence = (event,) if runner is None else (runner, event)
        message = f"completed in wave {event.wave_id} without a result for its id"
        return [Violation(self.invariant, event.request_id, message, evidence)]

    def finish(self, complete: bool) -> list[Violation]:
        return []


class PreemptionKeepsState:
    """A request preempted while the workers hold its runner state keeps that
    state until it resumes or ends: the workers never drop it meanwhile, and it
    resumes from it (as a cached request, never as a new one that starts over).
    That it runs in no wave while preempted is INV-004; that its state goes
    when it ends while preempted is INV-003."""

    invariant = "INV-006"
    rule = "a preempted request keeps its runner state and resumes from it"
    events = (LifecycleEvent, WaveEvent, RunnerEvent, EngineEvent)

    def __init__(self) -> None:
        self.held: set[str] = set()
        #: Preempted requests whose state the workers held, by their preempt event.
        self.kept: dict[str, LifecycleEvent] = {}
        #: Requests resumed from kept state, by wave id, until that wave is seen.
        self.resumed: dict[int, dict[str, LifecycleEvent]] = {}
        #: Requests resumed from kept state whose wave has not run yet.
        self.resuming: dict[str, LifecycleEvent] = {}

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, LifecycleEvent) and not event.rejected:
            self._lifecycle(event)
            return []
        if isinstance(event, WaveEvent):
            resumed = self.resumed.pop(event.wave_id, {})
            return [
                Violation(
                    self.invariant,
                    rid,
                    f"resumed in wave {event.wave_id} as a new request: its kept state is lost",
                    (schedule, event),
                )
                for rid, schedule in resumed.items()
                if rid in event.new_ids
            ]
        if isinstance(event, RunnerEvent):
            return self._runner(event)
        if isinstance(event, EngineEvent) and event.state == "dead":
            self.held.clear()
        return []

    def _lifecycle(self, event: LifecycleEvent) -> None:
        rid = event.request_id
        if event.dest in TERMINAL_STATES:
            self.resuming.pop(rid, None)
        if event.dest is RequestStatus.PREEMPTED and rid in self.held:
            self.kept[rid] = event
        elif event.source is RequestStatus.PREEMPTED:
            kept = self.kept.pop(rid, None)
            if kept is not None and event.dest is RequestStatus.RUNNING:
                self.resuming[rid] = event
                if event.wave_id is not None:
                    self.resumed.setdefault(event.wave_id, {})[rid] = event

    def _runner(self, event: RunnerEvent) -> list[Violation]:
        problems = []
        for rid in event.released:
            self.held.discard(rid)
            preempted = self.kept.get(rid)
            if preempted is not None:
                message = "the workers dropped its state while it was preempted"
                problems.append(Violation(self.invariant, rid, message, (preempted, event)))
        for rid in event.created:
            self.held.add(rid)
            resumed = self.resuming.get(rid)
            if resumed is not None:
                message = "its state was created again on resume: it started over"
                problems.append(Violation(self.invariant, rid, message, (resumed, event)))
        if self.resuming:
            for rid in event.executed:
                self.resuming.pop(rid, None)
        return problems

    def finish(self, complete: bool) -> list[Violation]:
        return []


def default_checkers() -> list[InvariantChecker]:
    """One checker per invariant: INV-001 to INV-012 and the adapters' INV-013..015."""
    return [
        OneLifecycleOwner(),
        ExecutionFollowsScheduler(),
        TerminalCleanup(),
        HooksNotLifecycles(),
        ResultsKeepIdentity(),
        PreemptionKeepsState(),
        WavesFollowPolicy(),
        AbortsTakeEffect(),
        StepsAsRequested(),
        OutputsSayWhetherFinal(),
        DeadlineDropsOnlyWaiting(),
        NothingRunsAsleep(),
        AdaptersWithinLimits(),
        PinnedAdaptersStay(),
        AdaptersInUseStay(),
    ]


class Auditor:
    """Runs invariant checkers over events and keeps what they find.

    Use it as an event subscriber (``engine.machine.subscribe(auditor.feed)``)
    or feed it a trace. ``on_violation`` is called for each violation as it is
    found (e.g. to raise :class:`InvariantViolation` or log).

    An auditor that saw the engine start checks everything. One attached to a
    running engine checks the requests admitted after it joined and ignores
    those already in flight, whose beginnings it never saw.
    """

    def __init__(
        self,
        checkers: Iterable[InvariantChecker] | None = None,
        on_violation: Callable[[Violation], None] | None = None,
    ) -> None:
        self.checkers = tuple(default_checkers() if checkers is None else checkers)
        self.on_violation = on_violation
        self.violations: list[Violation] = []
        self.complete = False
        self.dead = False
        self.events_seen = 0
        self.saw_start = False
        self._finished = False
        self._waves_in_view: set[int] = set()
        self._admitted_in_view: Recent[str, None] = Recent()
        self._feeds_by_kind: dict[type, tuple[Callable[[TraceEvent], list[Violation]], ...]] = {}

    def feed(self, event: TraceEvent) -> None:
        self.events_seen += 1
        if isinstance(event, EngineEvent):
            self.dead = self.dead or event.state == "dead"
            self.complete = event.state == "closed" and not self.dead
            self.saw_start = self.saw_start or event.state == "started"
        in_view = event if self.saw_start else self._in_view(event)
        if in_view is None:
            return
        kind = type(in_view)
        feeds = self._feeds_by_kind.get(kind)
        if feeds is None:
            feeds = self._feeds_by_kind[kind] = self._feeds_for(kind)
        for feed in feeds:
            found = feed(in_view)
            if found:
                for violation in found:
                    self._record(violation)

    def _feeds_for(self, kind: type) -> tuple[Callable[[TraceEvent], list[Violation]], ...]:
        """The ``feed`` of every checker that reads events of class ``kind``."""
        return tuple(
            checker.feed
            for checker in self.checkers
            if issubclass(kind, getattr(checker, "events", object))
        )

    def _in_view(self, event: TraceEvent) -> TraceEvent | None:
        """For an auditor that joined late: the part of ``event`` about requests it saw admitted."""
        known = self._admitted_in_view
        if isinstance(event, LifecycleEvent):
            if event.trigger == ADMIT:
                known[event.request_id] = None
            return event if event.request_id in known else None
        if isinstance(event, (DeliveryEvent, ResourceEvent, AbortEvent)):
            return event if event.request_id in known else None
        if isinstance(event, AdapterEvent) and event.request_id is not None:
            return event if event.request_id in known else None
        if isinstance(event, WaveEvent):
            self._waves_in_view.add(event.wave_id)
            keep = [i for i, rid in enumerate(event.scheduled_ids) if rid in known]
            return attrs.evolve(
                event,
                new_ids=tuple(r for r in event.new_ids if r in known),
                cached_ids=tuple(r for r in event.cached_ids if r in known),
                finished_ids=tuple(r for r in event.finished_ids if r in known),
                batch_keys=tuple(event.batch_keys[i] for i in keep if i < len(event.batch_keys)),
                num_steps=tuple(event.num_steps[i] for i in keep if i < len(event.num_steps)),
            )
        if isinstance(event, RunnerEvent):
            if event.wave_id not in self._waves_in_view:
                return None  # a wave scheduled before this auditor joined
            steps = dict(zip(event.progressed, event.steps, strict=False))
            return attrs.evolve(
                event,
                executed=tuple(r for r in event.executed if r in known),
                produced=tuple(r for r in event.produced if r in known),
                progressed=tuple(r for r in event.progressed if r in known),
                steps=tuple(steps[r] for r in event.progressed if r in known and r in steps),
                failed=tuple(r for r in event.failed if r in known),
                created=tuple(r for r in event.created if r in known),
                released=tuple(r for r in event.released if r in known),
            )
        return event

    def finish(self) -> list[Violation]:
        """Run the end-of-trace checks (once) and return every violation found."""
        if self._finished:
            return self.violations
        self._finished = True
        for checker in self.checkers:
            for violation in checker.finish(self.complete):
                self._record(violation)
        return self.violations

    def _record(self, violation: Violation) -> None:
        self.violations.append(violation)
        if self.on_violation is not None:
            self.on_violation(violation)


def audit_events(events: Iterable[TraceEvent]) -> list[Violation]:
    """Every violation in a finished stream of events (e.g. a trace file)."""
    auditor = Auditor()
    for event in events:
        auditor.feed(event)
    return auditor.finish()
