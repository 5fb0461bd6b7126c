"""The preemptive core harness on a virtual clock: deadlines, aging and the
deadline-aware policies (``edf``, ``slo``, and :class:`PatientEarliestDeadline`,
which reorders but never preempts), checked deterministically.

:class:`DeadlineCoreLifecycleMachine` gives the core a
:class:`~diffusion_runtime.testing.virtual_clock.VirtualClock`. Time passes
only by rules (a drawn number of ticks) and during waves (each wave takes
a drawn time, zero included), so every deadline, drop, aging decision and
step cost depends on draws alone, and a deadline can fall exactly on a step.
Requests draw ``deadline_s`` (or none) and priorities; a rule sends a full
wave of requests due in one tick; one (under a preemptive policy) fills the
running set with requests of one key and drawn ranks and then sends fewer
requests that outrank them than it holds, so only part of it is preempted;
and one (under a policy that does not preempt) lets a waiting request age
beside a running set of another key.

Beyond what the core and preemptive harnesses check, after every rule:

- with ``deadline_miss="drop"``, a request is aborted with reason
  ``"deadline"`` only if it was WAITING or PREEMPTED and its deadline was at
  or before the step's time, and no waiting or preempted request whose
  deadline had passed when a step began is still active after it;
- with ``"run_late"``, no request is ever dropped for its deadline (late
  requests complete: the core harness requires every untouched request to);
- every wave follows the policy and the aging bound: the oldest request
  that has aged is in the wave (under a policy that does not preempt, a
  wave that continues running requests may leave it out, but then no request
  admitted after an aged one left out may join it, and while it has room every
  waiting request of its key admitted before the first aged one of another
  key joins it), and no left-out request
  of the wave's key outranks one the policy chose for it, by the policy's
  full order, tie-breaks included: aged before young, aged ones in admission
  order; then ``priority`` by priority, ``edf`` (and
  :class:`PatientEarliestDeadline`) by deadline (none: last) then priority,
  ``slo`` on time by deadline then priority, then without a deadline by
  priority, then late (the harness compares only where the cost model
  cannot change the order); then admission order. Without preemption only
  the requests that join the wave were chosen. So a request preempted for a
  wave never outranks one of its key the wave kept running: preemption
  picks the worst-ranked.

Lifecycle event times stay on the real clock; deadlines are compared only
with the virtual time of the step, here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import invariant, precondition, rule

from diffusion_runtime.core import StepResult
from diffusion_runtime.fsm import (
    DEADLINE_REASON,
    STARTED_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    LifecycleEvent,
    RequestStatus,
)
from diffusion_runtime.fsm.events import TraceEvent, WaveEvent
from diffusion_runtime.sampling_params import MAX_PRIORITY, SamplingParams
from diffusion_runtime.scheduler.cost_meter import START_WINDOW_WAVES
from diffusion_runtime.scheduler.policies import (
    EarliestDeadlinePolicy,
    PriorityPolicy,
    Rank,
    SloAwarePolicy,
)
from diffusion_runtime.scheduler.step_cost import DEFAULT_STEP_S, IDLE_AFTER_S
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine
from diffusion_runtime.testing.virtual_clock import VirtualClock

#: The harness's unit of virtual time: a binary fraction, so sums of ticks are exact.
TICK_S = 2.0**-8

#: The ``slo`` classes, best first, as :class:`SloAwarePolicy` states them.
_ON_TIME, _NO_DEADLINE, _LATE = 0, 1, 2


class PatientEarliestDeadline(EarliestDeadlinePolicy):
    """Earliest deadline first without preemption: the shape of a user's policy
    that reorders the queue but never preempts. Under it, in step mode, a
    running set keeps its key and only the requests that join it are chosen;
    the harness checks the aging bound's form for such a policy."""

    preemptive = False


def tick_deadlines(max_ticks: int = 8) -> st.SearchStrategy[float | None]:
    """``deadline_s`` draws for the harness: none, or a whole number of ticks."""
    return st.none() | st.integers(1, max_ticks).map(lambda ticks: ticks * TICK_S)


class DeadlineCoreLifecycleMachine(CoreLifecycleMachine):
    """The preemptive harness on a virtual clock; pass it as ``base=`` to
    :func:`~diffusion_runtime.testing.core_harness.core_lifecycle_machine`
    with params that draw deadlines (:func:`tick_deadlines`) and a config naming
    the policy (``edf``, ``slo``), ``deadline_miss`` and ``scheduling_aging_s``
    (a few dozen ticks, so aging is reached)."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.wave_s = 0.0
        #: The longest time the cost meter can have charged to one wave (see
        #: :meth:`_note_wave_charge`), and when the last wave that ran steps ended.
        self.longest_charge_s = 0.0
        self.last_wave_end: float | None = None
        self.step_now = 0.0
        self.deadlines: dict[str, float | None] = {}
        self.arrivals: dict[str, float] = {}
        self.admission_order: dict[str, int] = {}
        self._admissions = itertools.count()
        self.preempted_since_wave: list[str] = []
        self.joined_since_wave: set[str] = set()
        self.deadline_problems: list[str] = []
        super().__init__()

    def core_clock(self) -> Callable[[], float]:
        return self.clock

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def let_time_pass(self, data: st.DataObject) -> None:
        """A drawn number of ticks pass between steps."""
        self.clock.advance(data.draw(st.integers(1, 4), label="ticks") * TICK_S)

    @precondition(lambda self: self._alive and bool(self._deadlines_ahead()))
    @rule(data=st.data())
    def let_time_pass_to_a_deadline(self, data: st.DataObject) -> None:
        """Time passes to exactly the deadline of a waiting or preempted request (a
        drawn one, the nearest first when shrinking): with ``"drop"`` the next step
        must drop it, at the boundary a real clock never hits."""
        deadline = data.draw(st.sampled_from(self._deadlines_ahead()), label="deadline")
        self.clock.advance(deadline - self.clock.now)

    @precondition(lambda self: self._alive and bool(self._started_deadlines_ahead()))
    @rule(data=st.data())
    def let_a_started_request_reach_its_deadline(self, data: st.DataObject) -> None:
        """Time passes to exactly the deadline of a running or preempted request, and
        a step: with ``"drop"`` a preempted one must be dropped (and the state the
        workers kept for it released), and a running one must not (INV-011)."""
        deadline = data.draw(st.sampled_from(self._started_deadlines_ahead()), label="deadline")
        self.clock.advance(deadline - self.clock.now)
        for rid, due in self.deadlines.items():
            if due == deadline and self.states.get(rid) in STARTED_STATES:
                self.reach.note(f"path: a {self.states[rid].name} request reached its deadline")
        self._step()

    @precondition(lambda self: self._alive and self._next_aging() is not None)
    @rule()
    def let_time_pass_to_an_aging_bound(self) -> None:
        """Time passes to exactly the moment an active request ages: from the next
        step on it goes before every younger request, whatever the policy says."""
        next_aging = self._next_aging()
        assert next_aging is not None
        self.clock.advance(next_aging - self.clock.now)

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def set_wave_time(self, data: st.DataObject) -> None:
        """From now on every wave takes this long on the virtual clock (zero: no time)."""
        self.wave_s = data.draw(st.integers(0, 3), label="wave ticks") * TICK_S

    @precondition(lambda self: self._alive and any(map(self._is_active, self.records)))
    @rule(data=st.data())
    def add_urgent(self, data: st.DataObject) -> None:
        """A step, then a full wave of requests due in a few ticks arrives, and a step:
        ``edf`` preempts for them; ``slo`` too while they can make it, and demotes
        them once they cannot."""
        self._add_a_wave_between_steps(
            data,
            lambda drawn, active: attrs.evolve(
                drawn,
                deadline_s=data.draw(st.integers(1, 4), label="urgent ticks") * TICK_S,
                num_inference_steps=max(p.num_inference_steps for p in active),
            ),
        )

    @precondition(
        lambda self: (
            self._alive and self.core.scheduler.policy.preemptive and self.config.max_num_seqs > 1
        )
    )
    @rule(data=st.data())
    def preempt_part_of_a_running_set(self, data: st.DataObject) -> None:
        """Requests of one batch key, each with a drawn priority and deadline, fill the
        running set; a step, then fewer requests of that key than the running set
        holds arrive, outranking every active one (a better priority, due in a few
        ticks), and a step: a preemptive policy preempts only part of the running
        set, and must pick the worst-ranked."""
        base = data.draw(self.params)
        active = sum(1 for rid in self.records if self._is_active(rid))
        for _ in range(max(0, self.config.max_num_seqs - active)):
            params = attrs.evolve(
                base,
                priority=data.draw(st.integers(0, 3), label="priority"),
                deadline_s=data.draw(tick_deadlines(), label="deadline"),
            )
            self._add(data, data.draw(self.prompts), params, failing=False)
        urgent = data.draw(st.integers(1, self.config.max_num_seqs - 1), label="urgent requests")
        self._add_a_wave_between_steps(
            data,
            lambda _drawn, active: attrs.evolve(
                base,
                priority=max(min(p.priority for p in active) - 1, -MAX_PRIORITY),
                deadline_s=data.draw(st.integers(1, 4), label="urgent ticks") * TICK_S,
            ),
            urgent,
        )

    @precondition(
        lambda self: (
            self._alive
            and isinstance(self.core.scheduler.policy, SloAwarePolicy)
            and not any(map(self._is_active, self.records))
        )
    )
    @rule(data=st.data())
    def add_a_late_request_beside_slack(self, data: st.DataObject) -> None:
        """Under ``slo``, on an engine with nothing to do: ``max_num_seqs`` requests due
        in 16 s and one like them due in a tick arrive; two ticks pass and a step:
        the late one must run at once (the others have slack for it), not wait for
        them all (with ``"drop"``, it is dropped first)."""
        base = data.draw(self.params)
        for _ in range(self.config.max_num_seqs):
            far = attrs.evolve(base, deadline_s=4096 * TICK_S)
            self._add(data, data.draw(self.prompts), far, failing=False)
        late = attrs.evolve(base, deadline_s=TICK_S)
        self._add(data, data.draw(self.prompts), late, failing=False)
        self.clock.advance(2 * TICK_S)
        self._step()

    @precondition(
        lambda self: (
            self._alive
            and not self.core.scheduler.policy.preemptive
            and bool(self._beside_a_running_set())
        )
    )
    @rule(data=st.data())
    def let_a_request_age_beside_a_running_set(self, data: st.DataObject) -> None:
        """Under a policy that does not preempt: a waiting request of another batch
        key than a running one ages, a request like the running one arrives behind
        it, and a step. Only requests admitted before the aged one may join the
        running set, which drains. (A preemptive policy runs the aged request at
        once: the rule that lets time pass to an aging bound reaches that.)"""
        running, waiting = data.draw(
            st.sampled_from(self._beside_a_running_set()), label="running, waiting"
        )
        ages_at = self.arrivals[waiting] + self.config.scheduling_aging_s
        self.clock.advance(max(0.0, ages_at - self.clock.now))
        self._add(data, data.draw(self.prompts), self.records[running].params, failing=False)
        self._step()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def deadlines_and_ranking_hold(self) -> None:
        assert not self.deadline_problems, self.deadline_problems[0]

    # -- stepping on the virtual clock -------------------------------------------------

    def _queue(self, rid: str, prompt: Any, params: SamplingParams, seed: int) -> None:
        """A request arrives when it is queued (the core's arrival time), not when
        the next step admits it: its deadline counts from now."""
        super()._queue(rid, prompt, params, seed)
        now = self.clock.now
        self.arrivals[rid] = now
        self.deadlines[rid] = None if params.deadline_s is None else now + params.deadline_s

    def _step(self, during_wave: Callable[[], None] | None = None) -> StepResult | None:
        self.step_now = now = self.clock.now
        due = sorted(
            rid
            for rid in {*self.states, *self.queued}
            if self._waits(rid) and self._passed(rid, now)
        )
        if any(self.deadlines[rid] == now for rid in due):
            self.reach.note("path: a deadline fell exactly on a step")

        def during_the_wave() -> None:
            self.clock.advance(self.wave_s)
            if during_wave is not None:
                during_wave()

        result = super()._step(during_the_wave)
        if self.config.deadline_miss == "drop" and not self.dead:
            survivors = [rid for rid in due if self.states[rid] not in TERMINAL_STATES]
            assert not survivors, (
                f"{survivors} waited past their deadlines at {now}, and are "
                f"{[self.states[rid].name for rid in survivors]} after the step"
            )
        return result

    def _record(self, event: TraceEvent) -> None:
        super()._record(event)
        if isinstance(event, LifecycleEvent) and not event.rejected:
            self._follow(event)
        elif isinstance(event, WaveEvent) and event.scheduled_ids:
            self._note_wave_charge(event)
            self._check_wave(event)
            self.preempted_since_wave.clear()
            self.joined_since_wave.clear()

    def _follow(self, event: LifecycleEvent) -> None:
        rid = event.request_id
        if event.source is None:
            self.admission_order[rid] = next(self._admissions)
        elif event.dest is RequestStatus.PREEMPTED:
            self.preempted_since_wave.append(rid)
        elif event.dest is RequestStatus.RUNNING and event.source in WAITING_STATES:
            self.joined_since_wave.add(rid)
        elif event.dest is RequestStatus.FINISHED_ABORTED and event.reason == DEADLINE_REASON:
            self._check_drop(event)
        elif event.dest is RequestStatus.FINISHED_COMPLETED and self._passed(rid, self.clock.now):
            self.reach.note("path: a late request completed")

    def _check_drop(self, event: LifecycleEvent) -> None:
        rid, source, deadline = event.request_id, event.source, self.deadlines[event.request_id]
        if self.config.deadline_miss != "drop":
            self.deadline_problems.append(f"{rid!r} dropped for its deadline under run_late")
        elif source not in WAITING_STATES:
            self.deadline_problems.append(f"{rid!r} dropped for its deadline while {source}")
        elif deadline is None or deadline > self.step_now:
            self.deadline_problems.append(
                f"{rid!r} dropped at {self.step_now}, before its deadline {deadline}"
            )
        self.records[rid].aborted = True
        where = " while preempted" if source is RequestStatus.PREEMPTED else ""
        self.reach.note(f"path: dropped at its deadline{where}")

    # -- the policy and the aging bound, wave by wave ----------------------------------

    def _check_wave(self, event: WaveEvent) -> None:
        now, order = self.step_now, self.admission_order
        active = self.core.scheduler.requests
        scheduled = [rid for rid in event.scheduled_ids if rid in active]
        left_out = [rid for rid, s in self.states.items() if s in WAITING_STATES and rid in active]
        joined = [rid for rid in scheduled if rid in self.joined_since_wave]
        continued = [rid for rid in scheduled if rid not in self.joined_since_wave]
        # A policy that does not preempt chose only who joined a wave that continues
        # running requests (request mode never has running requests when it plans).
        only_joiners_chosen = not self.core.scheduler.policy.preemptive and bool(continued)
        chosen = joined if only_joiners_chosen else scheduled
        may_join_before = math.inf  # without preemption: the first aged request left out
        if only_joiners_chosen:
            may_join_before = self._check_a_running_set_drains(
                event.wave_id, scheduled, joined, left_out, active[continued[0]].batch_key, now
            )
        aged = [rid for rid in (*scheduled, *left_out) if self._aged(rid, now)]
        if aged:
            oldest = min(aged, key=order.__getitem__)
            if oldest in scheduled:
                self.reach.note("path: an aged request ran first")
            elif not only_joiners_chosen:
                self.deadline_problems.append(
                    f"wave {event.wave_id} left out {oldest!r}, the oldest aged request"
                )
        preempted = [rid for rid in self.preempted_since_wave if rid in left_out]
        kept_keys = {active[rid].batch_key for rid in continued}
        if any(active[rid].batch_key in kept_keys for rid in preempted):
            self.reach.note("path: part of the running set preempted")
        for waiting in left_out:
            if order[waiting] > may_join_before:
                continue  # it may not join: an aged request admitted before it is left out
            key = active[waiting].batch_key
            for rid in chosen:
                if active[rid].batch_key != key:
                    continue
                # Whom preemption picked: one preempted for this wave, one kept running.
                picked = waiting in preempted and rid in continued
                if self._outranks(waiting, rid, now):
                    self.deadline_problems.append(
                        f"wave {event.wave_id} ({type(self.core.scheduler.policy).__name__}) "
                        f"ran {rid!r} ({self._describe(rid)}) and "
                        f"{'preempted' if picked else 'left out'} {waiting!r}, which "
                        f"outranks it ({self._describe(waiting)}) at {now}"
                    )
                self._note_policy_paths(waiting, rid, now, picked)

    def _check_a_running_set_drains(
        self,
        wave_id: int,
        scheduled: list[str],
        joined: list[str],
        left_out: list[str],
        running_key: Hashable,
        now: float,
    ) -> float:
        """The aging bound without preemption, for a wave that continues a running
        set: no request admitted after an aged request left out of it joins, and
        while it has room every waiting request of its key admitted before the
        first aged one of another key joins. Returns the admission order only
        requests admitted before may join (infinite: any)."""
        order, active = self.admission_order, self.core.scheduler.requests
        aged_left_out = sorted(
            (rid for rid in left_out if self._aged(rid, now)), key=order.__getitem__
        )
        first = order[aged_left_out[0]] if aged_left_out else math.inf
        passed = [rid for rid in joined if order[rid] > first]
        if passed:
            self.deadline_problems.append(
                f"wave {wave_id} let {passed} join, admitted after {aged_left_out[0]!r}, "
                "which has aged and was left out"
            )
        blocking = [rid for rid in aged_left_out if active[rid].batch_key != running_key]
        blocked_from = order[blocking[0]] if blocking else math.inf
        if len(scheduled) < self.config.max_num_seqs:
            of_its_key = [rid for rid in left_out if active[rid].batch_key == running_key]
            kept_out = [rid for rid in of_its_key if order[rid] < blocked_from]
            if kept_out:
                self.deadline_problems.append(
                    f"wave {wave_id} had room but left out {kept_out}, of the running key "
                    f"and admitted before any aged request of another key"
                )
            elif of_its_key:
                self.reach.note("path: a running set with room held a request back for an aged one")
        return first

    def _outranks(self, left_out: str, chosen: str, now: float) -> bool:
        """Whether the policy must run ``left_out`` before ``chosen`` (same batch key),
        by its full order: an aged request before a younger one, aged ones in
        admission order; then the policy's rank with its tie-breaks (see
        :meth:`_known_ranks`); then admission order."""
        left_out_aged, chosen_aged = self._aged(left_out, now), self._aged(chosen, now)
        order = self.admission_order
        if left_out_aged or chosen_aged:
            return left_out_aged and (not chosen_aged or order[left_out] < order[chosen])
        ranks = self._known_ranks(left_out, chosen, now)
        return ranks is not None and (*ranks[0], order[left_out]) < (*ranks[1], order[chosen])

    def _known_ranks(self, first: str, second: str, now: float) -> tuple[Rank, Rank] | None:
        """The ranks of two young requests as the policy states them, to compare
        before their admission order; ``None`` where the harness cannot know them.

        ``priority``: the priority. ``edf`` (any :class:`EarliestDeadlinePolicy`):
        the deadline (none: last), then the priority. ``slo``: on time (by the
        deadline, then the priority), then without a deadline (by the priority),
        then late (by the remaining time the cost model estimates, then the
        priority). Whether a request is on time also rests on the cost model: the
        harness knows it only of one sure to be on time or sure to be late (see
        :meth:`_slo_class`), and compares the ranks of two requests only where the
        order cannot depend on what it does not know.
        """
        policy = self.core.scheduler.policy
        priorities = (self._priority(first), self._priority(second))
        if isinstance(policy, PriorityPolicy):
            return (priorities[0],), (priorities[1],)
        deadlines = (self._deadline_or_inf(first), self._deadline_or_inf(second))
        if isinstance(policy, EarliestDeadlinePolicy):
            return (deadlines[0], priorities[0]), (deadlines[1], priorities[1])
        if not isinstance(policy, SloAwarePolicy):
            return None
        classes = (self._slo_class(first, now), self._slo_class(second, now))
        if classes[0] is None or classes[1] is None:
            return None
        if classes[0] == classes[1] == _ON_TIME:
            return (deadlines[0], priorities[0]), (deadlines[1], priorities[1])
        if classes[0] == classes[1] == _NO_DEADLINE:
            return (priorities[0],), (priorities[1],)
        if _LATE not in classes:
            return (classes[0],), (classes[1],)
        late_place = self._slo_late_place(now)
        if classes[0] == classes[1] or late_place is None:
            return None  # late ones by the time the cost model gives them, or by slack
        place = {_ON_TIME: _ON_TIME, _NO_DEADLINE: _NO_DEADLINE, _LATE: late_place}
        return (place[classes[0]],), (place[classes[1]],)

    def _slo_late_place(self, now: float) -> float | None:
        """Where ``slo`` must put its young late requests, where the harness can be
        sure: last (behind requests without a deadline) while no young request can
        be on time; first while every young request with a deadline is late or on
        time with slack for the time of every such request
        (:meth:`_time_bound` each, one after another); else ``None``."""
        young = [
            rid
            for rid in self.core.scheduler.requests
            if rid in self.deadlines and not self._aged(rid, now)
        ]
        with_deadline = [rid for rid in young if self.deadlines[rid] is not None]
        not_late = [rid for rid in with_deadline if not self._surely_late(rid, now)]
        if not not_late:
            return _LATE
        total = sum(self._time_bound(rid) for rid in with_deadline)
        if all(self._deadline_or_inf(rid) - now >= total for rid in not_late):
            return -1.0
        return None

    def _slo_class(self, rid: str, now: float) -> int | None:
        """``rid``'s ``slo`` class where it is sure (``None``: on time or late, as the
        cost model judges)."""
        if self.deadlines[rid] is None:
            return _NO_DEADLINE
        if self._surely_late(rid, now):
            return _LATE
        return _ON_TIME if self._surely_on_time(rid, now) else None

    def _note_policy_paths(self, left_out: str, chosen: str, now: float, picked: bool) -> None:
        """Notes the paths of a pair the policy check compared; ``picked``: preemption
        chose between them (``left_out`` preempted, ``chosen`` kept running)."""
        if self._aged(left_out, now) or self._aged(chosen, now):
            return
        ranks = self._known_ranks(left_out, chosen, now)
        policy = self.core.scheduler.policy
        if isinstance(policy, SloAwarePolicy) and None in (
            self._slo_class(left_out, now),
            self._slo_class(chosen, now),
        ):
            ranks = None  # a bound, not the ranks: one may be late
        if ranks is not None and ranks[0][0] == ranks[1][0]:
            by = "priority" if ranks[0] != ranks[1] else "admission order"
            self.reach.note(f"path: a tie broken by {by}")
            if picked:
                self.reach.note(f"path: a preemption tie broken by {by}")
        left_out_by, chosen_by = self._deadline_or_inf(left_out), self._deadline_or_inf(chosen)
        if isinstance(policy, SloAwarePolicy):
            if left_out_by < chosen_by and self._surely_late(left_out, now):
                self.reach.note("path: slo demoted a late request")
            if self._surely_late(chosen, now) and self._slo_class(left_out, now) == _ON_TIME:
                self.reach.note("path: slo ran a late request in an on-time one's slack")
        elif isinstance(policy, EarliestDeadlinePolicy) and chosen_by < left_out_by:
            if left_out in self.preempted_since_wave:
                self.reach.note("path: edf preempted for an earlier deadline")
            elif (
                not policy.preemptive
                and self.admission_order[chosen] > self.admission_order[left_out]
            ):
                self.reach.note("path: a younger request went first by its deadline")

    def _describe(self, rid: str) -> str:
        return (
            f"admitted #{self.admission_order[rid]}, priority {self._priority(rid)}, "
            f"deadline {self.deadlines[rid]}, arrived {self.arrivals[rid]}"
        )

    # -- time --------------------------------------------------------------------------

    def _passed(self, rid: str, now: float) -> bool:
        deadline = self.deadlines.get(rid)
        return deadline is not None and deadline <= now

    def _beside_a_running_set(self) -> list[tuple[str, str]]:
        """``(running, waiting)`` pairs of requests of different batch keys."""
        requests = self.core.scheduler.requests
        running = sorted(r for r, s in self.states.items() if s is RequestStatus.RUNNING)
        waiting = sorted(r for r, s in self.states.items() if s is RequestStatus.WAITING)
        return [
            (r, w)
            for r in running
            for w in waiting
            if r in requests and w in requests and requests[r].batch_key != requests[w].batch_key
        ]

    def _deadlines_ahead(self) -> list[float]:
        """The deadlines still to come of waiting and preempted requests, nearest first."""
        now = self.clock.now
        return sorted(
            deadline
            for rid, deadline in self.deadlines.items()
            if deadline is not None and deadline > now and self._waits(rid)
        )

    def _started_deadlines_ahead(self) -> list[float]:
        """The deadlines still to come of running and preempted requests, nearest first."""
        now = self.clock.now
        return sorted(
            deadline
            for rid, deadline in self.deadlines.items()
            if deadline is not None and deadline > now and self.states.get(rid) in STARTED_STATES
        )

    def _waits(self, rid: str) -> bool:
        """Queued (the next step admits it), waiting or preempted."""
        return rid in self.queued or self.states.get(rid) in WAITING_STATES

    def _next_aging(self) -> float | None:
        now, aging_s = self.clock.now, self.config.scheduling_aging_s
        ahead = [
            arrival + aging_s
            for rid, arrival in self.arrivals.items()
            if arrival + aging_s > now and self._is_active(rid)
        ]
        return min(ahead, default=None)

    def _aged(self, rid: str, now: float) -> bool:
        return now - self.arrivals[rid] >= self.config.scheduling_aging_s

    def _priority(self, rid: str) -> int:
        return self.records[rid].params.priority

    def _deadline_or_inf(self, rid: str) -> float:
        deadline = self.deadlines[rid]
        return math.inf if deadline is None else deadline

    def _note_wave_charge(self, event: WaveEvent) -> None:
        """The most the cost meter can charge this wave (``step_now`` is when it was
        scheduled; it has run, and the clock moved on by :attr:`wave_s`): its own
        time, and in step mode the time since the last wave ended, or since the
        arrival of a request it starts if that came later, when shorter than
        :data:`IDLE_AFTER_S` (time passing between steps while requests run counts
        as what each step costs them)."""
        now = self.step_now
        charge = self.wave_s
        if self.config.resolved_mode == "step":
            arrivals = [self.arrivals[rid] for rid in event.new_ids if rid in self.arrivals]
            known = [t for t in (self.last_wave_end, min(arrivals, default=None)) if t is not None]
            gap = now - max(known) if known else 0.0
            if 0.0 <= gap < IDLE_AFTER_S:
                charge += gap
        self.longest_charge_s = max(self.longest_charge_s, charge)
        self.last_wave_end = now + self.wave_s

    def _surely_late(self, rid: str, now: float) -> bool:
        """Past its deadline: late whatever the cost model says (at a deadline exactly
        now, a request with no measured step cost still counts as on time)."""
        return self._deadline_or_inf(rid) < now

    def _surely_on_time(self, rid: str, now: float) -> bool:
        """No deadline, or slack for its :meth:`_time_bound`."""
        deadline = self.deadlines[rid]
        return deadline is None or deadline - now >= self._time_bound(rid)

    def _time_bound(self, rid: str) -> float:
        """The most time the policy can judge ``rid`` to need: every step, a start and
        a finish at the slowest step the cost model can have charged one wave
        (:attr:`longest_charge_s`)."""
        steps = self.core.scheduler.requests[rid].params.num_inference_steps
        # Each estimate the policy adds up (a step, a start, a finish) is an average
        # or a least of charges; a start spans the first waves after it.
        charges = steps + START_WINDOW_WAVES + 1
        return charges * max(self.longest_charge_s, DEFAULT_STEP_S)
