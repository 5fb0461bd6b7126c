"""Broken deadlines, aging and ranking: bugs in when a late request is dropped,
where the ``slo`` policy ranks it, how a running set that does not preempt
lets an aged request through, whom preemption picks and how a policy breaks
ties. Each is written the way it would slip in; the deadline harness
(:mod:`.deadline_harness`, in step mode: ``slo`` with the ``deadline_miss``
its target names, ``edf`` or ``priority`` with ``"drop"``, or, for
``"deadline-patient"``, :class:`~.deadline_harness.PatientEarliestDeadline`)
must catch each, and ``docs/auditing.md`` says which check does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

from diffusion_runtime.fsm import DEADLINE_REASON, LifecycleEvent, RequestStatus, Trigger
from diffusion_runtime.scheduler.base import BaseScheduler, Ended
from diffusion_runtime.scheduler.policies import (
    EarliestDeadlinePolicy,
    PriorityPolicy,
    SchedulingPolicy,
    SloAwarePolicy,
)
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace


def drop_hits_running_requests() -> Patch:
    def make(original: Any) -> Any:
        def expire_waiting(self: BaseScheduler, now: float) -> list[Ended]:
            ended = []
            deadlines = self._deadlines
            while deadlines and deadlines[0][0] <= now:
                request = heapq.heappop(deadlines)[2]
                # "late is late: drop it wherever it is"
                if not request.state.is_finished:
                    event = self.machine.fire(request, Trigger.ABORT, reason=DEADLINE_REASON)
                    ended.append(Ended(request, event))
            return ended

        return expire_waiting

    return _replace(BaseScheduler, "expire_waiting", make)


def drop_only_strictly_after_the_deadline() -> Patch:
    def make(original: Any) -> Any:
        def expire_waiting(self: BaseScheduler, now: float) -> list[Ended]:
            ended = []
            deadlines = self._deadlines
            # "past its deadline": one due exactly now waits another step
            while deadlines and deadlines[0][0] < now:
                request = heapq.heappop(deadlines)[2]
                if request.state in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                    event = self.machine.fire(request, Trigger.ABORT, reason=DEADLINE_REASON)
                    ended.append(Ended(request, event))
            return ended

        return expire_waiting

    return _replace(BaseScheduler, "expire_waiting", make)


def preempted_deadline_not_rewatched() -> Patch:
    def make(original: Any) -> Any:
        def on_preempted(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            del self.running[request.request_id]
            self.waiting[request.request_id] = request
            self.waiting.move_to_end(request.request_id, last=False)
            self.num_preemptions += 1
            # "its deadline is watched since its admission" - unless it passed while it ran

        return on_preempted

    return _replace(BaseScheduler, "_on_preempted", make)


def slo_serves_late_requests_first() -> Patch:
    def make(original: Any) -> Any:
        def judge(
            self: SloAwarePolicy, request: Request, now: float, engine_idle: bool
        ) -> tuple[tuple[float, ...], float]:
            priority = request.params.priority
            if request.deadline is None:
                return (1, 0.0, priority), 0.0
            needed = self.time_needed(request, engine_idle)
            if request.deadline - now < self.judged_time(request, engine_idle):
                return (-1, request.deadline, priority), needed  # "already late: most urgent"
            return (0, request.deadline, priority), needed

        return judge

    return _replace(SloAwarePolicy, "_judge", make)


def aged_request_checked_only_at_the_head() -> Patch:
    def make(original: Any) -> Any:
        def plan(
            self: BaseScheduler, now: float, *, may_preempt: bool
        ) -> tuple[list[Request], list[Request]]:
            if not self.running or (may_preempt and self.policy.preemptive):
                return original(self, now, may_preempt=may_preempt)  # type: ignore[no-any-return]
            free = self.max_num_running_reqs - len(self.running)
            if free <= 0 or not self.waiting:
                return [], []
            waiting = self.ranked(self.waiting.values(), now)
            key = next(iter(self.running.values())).batch_key
            if waiting[0].batch_key != key and self.is_aged(waiting[0], now):
                return [], []  # "drain the running set: the aged request's key goes next"
            return [], [r for r in waiting if r.batch_key == key][:free]

        return plan

    return _replace(BaseScheduler, "plan", make)


def running_set_closed_while_any_request_has_aged() -> Patch:
    def make(original: Any) -> Any:
        def plan(
            self: BaseScheduler, now: float, *, may_preempt: bool
        ) -> tuple[list[Request], list[Request]]:
            drains = self.running and not (may_preempt and self.policy.preemptive)
            if drains and any(self.is_aged(request, now) for request in self.waiting.values()):
                return [], []  # "a request has aged: let the running set drain"
            return original(self, now, may_preempt=may_preempt)  # type: ignore[no-any-return]

        return plan

    return _replace(BaseScheduler, "plan", make)


def preemption_ties_preempt_the_oldest() -> Patch:
    def make(original: Any) -> Any:
        def plan(
            self: BaseScheduler, now: float, *, may_preempt: bool
        ) -> tuple[list[Request], list[Request]]:
            if not (may_preempt and self.policy.preemptive and self.waiting):
                return original(self, now, may_preempt=may_preempt)  # type: ignore[no-any-return]
            candidates = [*self.running.values(), *self.waiting.values()]
            chosen = self._choose_batch(self.ranked(candidates, now), now)
            joining = [r for r in chosen if r.request_id not in self.running]
            key = chosen[0].batch_key
            of_key = [r for r in self.running.values() if r.batch_key == key]
            others = [r for r in self.running.values() if r.batch_key != key]
            # "preempt only what the joining requests need: the worst-ranked make room
            # (by aging and rank; the admission order after them only orders the queue)"
            excess = max(0, len(of_key) + len(joining) - self.max_num_running_reqs)
            worst_first = sorted(
                of_key,
                key=lambda r: (0,) if self.is_aged(r, now) else (1, self.policy.rank(r, now)),
                reverse=True,
            )
            return [*others, *worst_first[:excess]], joining

        return plan

    return _replace(BaseScheduler, "plan", make)


def priority_inverted() -> Patch:
    def make(original: Any) -> Any:
        def rank(self: PriorityPolicy, request: Request, now: float) -> tuple[float, ...]:
            return (-request.params.priority,)  # "the higher the priority, the sooner"

        return rank

    return _replace(PriorityPolicy, "rank", make)


def ties_keep_their_queue_position() -> Patch:
    def make(original: Any) -> Any:
        def order(
            self: SchedulingPolicy, requests: Sequence[Request], now: float, slots: int
        ) -> list[Request]:
            # "sorted() is stable: equal ranks keep their place, no tie-break needed"
            return sorted(requests, key=lambda request: tuple(self.rank(request, now)))

        return order

    return _replace(SchedulingPolicy, "order", make)


def slo_parks_late_requests() -> Patch:
    def make(original: Any) -> Any:
        def order(
            self: SloAwarePolicy, requests: Sequence[Request], now: float, slots: int
        ) -> list[Request]:
            # "a late request is lost anyway: it waits until no on-time request is left"
            return SchedulingPolicy.order(self, requests, now, slots)

        return order

    return _replace(SloAwarePolicy, "order", make)


def edf_ignores_priority() -> Patch:
    def make(original: Any) -> Any:
        def rank(self: EarliestDeadlinePolicy, request: Request, now: float) -> tuple[float, ...]:
            # "earliest deadline first; ties go to admission order"
            return (math.inf if request.deadline is None else request.deadline,)

        return rank

    return _replace(EarliestDeadlinePolicy, "rank", make)


#: Run by the deadline harness; the target names the configuration: ``"deadline-drop"``
#: or ``"deadline-run_late"`` (``slo`` with that ``deadline_miss``), ``"deadline-edf"`` or
#: ``"deadline-priority"`` (that policy, ``"drop"``) or ``"deadline-patient"``.
DEADLINE_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="deadline-drops-running", mode="step", target="deadline-drop",
             bug="the deadline drop also aborts running requests",
             patch=drop_hits_running_requests),
    Mutation(name="deadline-boundary-late", mode="step", target="deadline-drop",
             bug="a request due exactly at the step's time is not dropped",
             patch=drop_only_strictly_after_the_deadline),
    Mutation(name="preempted-deadline-forgotten", mode="step", target="deadline-drop",
             bug="a request preempted after its deadline passed is never dropped",
             patch=preempted_deadline_not_rewatched),
    Mutation(name="slo-late-first", mode="step", target="deadline-run_late",
             bug="the slo policy ranks late requests ahead of on-time ones",
             patch=slo_serves_late_requests_first),
    Mutation(name="slo-parks-late", mode="step", target="deadline-run_late",
             bug="the slo policy keeps a late request behind every on-time one, even those "
                 "with time to spare",
             patch=slo_parks_late_requests),
    Mutation(name="aged-checked-at-head", mode="step", target="deadline-patient",
             bug="a running set that does not preempt stops taking requests for an aged one of "
                 "another key only when it ranks first",
             patch=aged_request_checked_only_at_the_head),
    Mutation(name="aged-closes-running-set", mode="step", target="deadline-patient",
             bug="a running set that does not preempt takes no request while any request has "
                 "aged, even one of its own key",
             patch=running_set_closed_while_any_request_has_aged),
    Mutation(name="priority-inverted", mode="step", target="deadline-priority",
             bug="the priority policy runs the highest priority value first",
             patch=priority_inverted),
    Mutation(name="victim-ties-preempt-oldest", mode="step", target="deadline-priority",
             bug="preemption makes room among running requests of equal rank by preempting "
                 "the earliest to join, not the latest admitted",
             patch=preemption_ties_preempt_the_oldest),
    Mutation(name="ties-keep-queue-position", mode="step", target="deadline-priority",
             bug="equal ranks are left in the order the scheduler lists them (running, then "
                 "the last preempted) instead of admission order",
             patch=ties_keep_their_queue_position),
    Mutation(name="edf-ignores-priority", mode="step", target="deadline-edf",
             bug="edf breaks deadline ties by admission order, not priority",
             patch=edf_ignores_priority),
)  # fmt: skip
