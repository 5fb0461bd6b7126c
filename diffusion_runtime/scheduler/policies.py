"""Scheduling policies: the order in which waiting and running requests deserve to run.

A policy only ranks requests; the scheduler turns the ranking into waves,
head-of-line bypass and (step mode) preemption, and adds the aging bound that
makes starvation impossible whatever the policy says. See ``docs/schedulers.md``.
"""

from __future__ import annotations

import abc
import heapq
import math
from collections.abc import Sequence
from typing import ClassVar

from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.pipelines.registry import import_object
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.step_cost import StepCostModel

#: A policy's rank: compared as a tuple, lower runs first.
Rank = tuple[float, ...]


class SchedulingPolicy(abc.ABC):
    """Ranks requests for the scheduler; subclass it to write your own.

    The scheduler builds it as ``policy_cls(costs)``, where ``costs`` is the
    engine's online :class:`StepCostModel`, and calls :meth:`rank` for every
    waiting and running request at every wave, so keep it cheap. Ties are
    broken by admission order.
    """

    #: ``False`` keeps the waiting queue in arrival order with head-of-line
    #: blocking (the ``fifo`` behaviour); ``True`` orders it by :meth:`rank`
    #: and lets a request of another batch key pass a head it cannot batch with.
    reorders: ClassVar[bool] = True
    #: Whether (in step mode) a running request may be preempted at a step
    #: boundary for better-ranked ones; it keeps its progress and resumes later.
    preemptive: ClassVar[bool] = False

    def __init__(self, costs: StepCostModel) -> None:
        self.costs = costs

    @abc.abstractmethod
    def rank(self, request: Request, now: float) -> Rank:
        """The request's place at time ``now`` (the core's clock): lower runs first."""

    def order(self, requests: Sequence[Request], now: float, slots: int) -> list[Request]:
        """``requests`` best first, for a wave of at most ``slots`` requests: by
        :meth:`rank`, ties by admission order. Override it for an order that
        depends on the whole set; the scheduler puts aged requests before it."""
        return sorted(requests, key=lambda request: (tuple(self.rank(request, now)), request.order))

    def choose_batch(self, batches: Sequence[Sequence[Request]], now: float) -> int:
        """Which batch runs next: ``batches`` hold the best-ranked requests of each
        batch key (best first, at most ``max_num_seqs``), ordered by their best
        request. The default, ``0``, follows the best-ranked request."""
        return 0


class FifoPolicy(SchedulingPolicy):
    """Arrival order, head-of-line blocking, no preemption: the runtime's historic behaviour."""

    reorders = False

    def rank(self, request: Request, now: float) -> Rank:
        return (request.arrival_time,)


class PriorityPolicy(SchedulingPolicy):
    """Lowest ``priority`` first (as vLLM); better priority preempts worse in step mode."""

    preemptive = True

    def rank(self, request: Request, now: float) -> Rank:
        return (request.params.priority,)


class EarliestDeadlinePolicy(SchedulingPolicy):
    """Earliest deadline first; requests without a deadline go last, then by priority."""

    preemptive = True

    def rank(self, request: Request, now: float) -> Rank:
        deadline = math.inf if request.deadline is None else request.deadline
        return (deadline, request.params.priority)


#: The classes of :class:`SloAwarePolicy`, best first.
_ON_TIME, _NO_DEADLINE, _LATE = 0, 1, 2


class SloAwarePolicy(SchedulingPolicy):
    """Earliest deadline first among the requests that can still meet their deadline.

    Whether a request can still make it depends on whether it has started
    (see :meth:`time_needed`). A running or preempted one is given every
    chance: it is late only if it would be late even at the fastest step
    measured for its key, since demoting one that could still make it loses
    its deadline for sure (and flips with the noise of each step). One that
    has not started yet is judged on what its start will really cost: the
    start cost learnt for its key (on an idle engine, the slow first steps of
    a cold machine) plus its steps at the average step, with a margin of
    :attr:`start_margin` (see :meth:`judged_time`). Requests that can no
    longer make it run only in the slack of those that can: each goes before
    the on-time requests only where all of those would still finish by their
    deadlines after it, else behind every request with or without a deadline
    (see :meth:`order`). So an overload sacrifices the fewest requests
    instead of making every one late (plain earliest deadline first would
    serve the hopeless ones first and miss the rest too), and a late request
    does not wait for on-time ones that have time to spare. Late requests run
    shortest remaining work first. Between batch keys it runs the batch whose
    running first meets the most deadlines (see :meth:`choose_batch`).
    Preemptive in step mode.
    """

    preemptive = True
    #: The share of its estimated time by which a request that has not started may
    #: look late and still count as able to make its deadline (see :meth:`judged_time`).
    start_margin: ClassVar[float] = 0.05

    def time_needed(
        self, request: Request, engine_idle: bool, batch_size: int | None = None
    ) -> float:
        """Seconds ``request`` needs to finish from now, in a wave of ``batch_size``
        (``None``: the key's last size). Started (it ran steps whose state the
        workers hold; a preemption in request mode clears them, as it restarts):
        its remaining steps at the fastest step measured, plus the least finish
        cost measured for its key. Not started: its key's start cost on an idle
        or a busy engine (``engine_idle``), its steps at the average step, and
        the key's average finish cost (see :class:`StepCostModel`)."""
        costs, key = self.costs, request.batch_key
        if request.num_steps is not None:
            steps_s = request.remaining_steps * costs.fastest_seconds_per_step(key, batch_size)
            return steps_s + costs.finish_seconds(key, least=True)
        start_s = costs.start_seconds(key, engine_idle) + costs.finish_seconds(key)
        return start_s + request.remaining_steps * costs.seconds_per_step(key, batch_size)

    def judged_time(
        self, request: Request, engine_idle: bool, batch_size: int | None = None
    ) -> float:
        """The time :meth:`rank` and :meth:`choose_batch` hold against the deadline:
        :meth:`time_needed`, less :attr:`start_margin` of it for a request that has
        not started. A start's estimate misses by a few percent either way (the
        machine's speed drifts), and a request demoted by such a miss surely
        loses its deadline, while one started by such a miss risks only its own."""
        return self._less_margin(request, self.time_needed(request, engine_idle, batch_size))

    def _less_margin(self, request: Request, needed: float) -> float:
        return needed if request.num_steps is not None else needed * (1.0 - self.start_margin)

    def rank(self, request: Request, now: float) -> Rank:
        return self._judge(request, now, self.costs.is_idle(now))[0]

    def _judge(self, request: Request, now: float, engine_idle: bool) -> tuple[Rank, float]:
        """The request's rank and :meth:`time_needed` (0 without a deadline)."""
        priority = request.params.priority
        if request.deadline is None:
            return (_NO_DEADLINE, 0.0, priority), 0.0
        needed = self.time_needed(request, engine_idle)
        remaining_s = self._less_margin(request, needed)
        if request.deadline - now < remaining_s:
            return (_LATE, remaining_s, priority), needed
        return (_ON_TIME, request.deadline, priority), needed

    def order(self, requests: Sequence[Request], now: float, slots: int) -> list[Request]:
        """On-time requests by deadline, each late one placed as early as their slack allows.

        The on-time requests' finishes are estimated by list scheduling over
        ``slots`` places, each request taking :meth:`time_needed`; a request's
        slack is its deadline less that finish. Late requests, shortest
        remaining first, each go before the first on-time request from which on
        every on-time request keeps a slack of at least the late one's time
        (their slacks then shrink by it); where none does, it goes after the
        requests without a deadline. So a late request runs in the slack of
        the on-time ones instead of waiting for all of them. O(n log n).
        """
        idle = self.costs.is_idle(now)
        ranked = sorted(
            ((self._judge(request, now, idle), request.order, request) for request in requests),
            key=lambda entry: (entry[0][0], entry[1]),
        )
        on_time = [(needed, r) for (rank, needed), _, r in ranked if rank[0] == _ON_TIME]
        late = [(needed, r) for (rank, needed), _, r in ranked if rank[0] == _LATE]
        if not on_time or not late:
            return [request for *_, request in ranked]
        free_at = [now] * max(1, min(slots, len(on_time)))
        least_slack: list[float] = []
        for needed, request in on_time:
            finish = heapq.heappop(free_at) + needed
            heapq.heappush(free_at, finish)
            assert request.deadline is not None
            least_slack.append(request.deadline - finish)
        for index in range(len(least_slack) - 2, -1, -1):  # the least slack from each on
            least_slack[index] = min(least_slack[index], least_slack[index + 1])
        placed: list[list[Request]] = [[] for _ in on_time]
        last: list[Request] = []
        # Places only move later: a longer request fits no earlier than a shorter one,
        # and every on-time request from a late one's place on is delayed by it.
        position, delay = 0, 0.0
        for needed, request in late:
            while position < len(on_time) and least_slack[position] - delay < needed:
                position += 1
            if position == len(on_time):
                last.append(request)
            else:
                placed[position].append(request)
                delay += needed
        result = [
            r
            for before, (_, request) in zip(placed, on_time, strict=True)
            for r in (*before, request)
        ]
        result += [r for (rank, _), _, r in ranked if rank[0] not in (_ON_TIME, _LATE)]
        return result + last

    def choose_batch(self, batches: Sequence[Sequence[Request]], now: float) -> int:
        """The batch whose running first lets the most requests meet their deadlines.

        Each batch is tried first, the others following in the given order,
        and the requests that would finish by their deadline are counted
        (see :meth:`_deadlines_met`). On a tie the batch holding a running
        request that can still make its deadline wins (preempting it would
        save no deadline and may cost its own), then the fullest (one urgent
        request of another key does not idle a batch of them), then the best
        ranked, so among late requests the shortest runs first.
        """

        def value(index: int) -> tuple[int, bool, int, int]:
            batch = batches[index]
            order = [batch, *(other for i, other in enumerate(batches) if i != index)]
            keeps_on_time = any(
                request.state is RequestStatus.RUNNING and self.rank(request, now)[0] == _ON_TIME
                for request in batch
            )
            return (self._deadlines_met(order, now), keeps_on_time, len(batch), -index)

        return max(range(len(batches)), key=value)

    def _deadlines_met(self, order: Sequence[Sequence[Request]], now: float) -> int:
        """How many requests meet their deadline if ``order``'s batches run one after
        another, each from its start until its slowest request is done, each
        request taking :meth:`time_needed` at its batch's size (the first batch
        starts on the engine as it is now, the others on a busy one); a request
        counts as meeting it by its :meth:`judged_time`."""
        met, start, idle = 0, now, self.costs.is_idle(now)
        for batch in order:
            end = start
            for request in batch:
                needed = self.time_needed(request, idle, len(batch))
                judged = start + self._less_margin(request, needed)
                met += request.deadline is not None and judged <= request.deadline
                end = max(end, start + needed)
            start, idle = end, False
        return met


BUILTIN_POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fifo": FifoPolicy,
    "priority": PriorityPolicy,
    "edf": EarliestDeadlinePolicy,
    "slo": SloAwarePolicy,
}


def resolve_policy_class(spec: str | type) -> type[SchedulingPolicy]:
    """The policy class named by ``EngineConfig.scheduling_policy``."""
    if isinstance(spec, str):
        found = BUILTIN_POLICIES.get(spec)
        policy = found if found is not None else import_object(spec)
    else:
        policy = spec
    if not (isinstance(policy, type) and issubclass(policy, SchedulingPolicy)):
        raise TypeError(f"scheduling_policy {spec!r} is not a SchedulingPolicy subclass")
    return policy
