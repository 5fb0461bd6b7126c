"""Sleep and wake rules for a harness that steps an :class:`EngineCore` itself.

The core sleeps at a drawn level between two steps, with whatever the other
rules left waiting, running or preempted; every other rule goes on while it
sleeps (requests arrive and wait, aborts apply, steps run nothing, the core
closes), until a rule wakes it (the teardown wakes a core left asleep, so
what waited runs). Checked, beyond what the harness checks anyway:

- nothing runs while asleep: INV-012 (``NothingRunsAsleep``), which the
  harness's auditor runs over every event, and the core says ``SLEEPING``;
- at level 2 the workers hold no weight storage while asleep;
- no request is lost or ends otherwise because of sleep, and outputs after the
  wake equal the pipeline's own (the harness's outcome and oracle checks,
  which hold across sleeps: a request that slept completes as the oracle).

Every draw comes from hypothesis: the core is stepped by the test's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import hypothesis.strategies as st
from hypothesis.stateful import invariant, precondition, rule

from diffusion_runtime.core import EngineCore, EngineState, StepResult
from diffusion_runtime.errors import PipelineContractError
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent, RequestStatus
from diffusion_runtime.fsm.events import EngineEvent, TraceEvent
from diffusion_runtime.testing.harness_root import HarnessRoot


class SleepRules(HarnessRoot):
    """Sleep, wake and their checks; the harness provides the core and its records."""

    #: The levels a sleep draws from (empty: the core never sleeps).
    sleep_levels: ClassVar[tuple[int, ...]] = (1, 2)

    core: EngineCore
    states: dict[str, RequestStatus]
    queued: set[str]
    closed: bool
    dead: bool
    _step: Callable[[], StepResult | None]

    def __init__(self) -> None:
        super().__init__()
        #: The level the core sleeps at, as its trace says (``None``: awake).
        self.asleep_at: int | None = None
        #: Ids active when the core last went to sleep, until they end.
        self.slept: set[str] = set()

    @precondition(lambda self: self._can_sleep)
    @rule(data=st.data())
    def sleep(self, data: st.DataObject) -> None:
        """Sleep between two steps, with whatever is queued, waiting, running or
        preempted. Either the core sleeps until a rule wakes it, or (a nap) it
        steps while asleep (nothing runs), wakes, and steps on."""
        slept = self._sleep(data.draw(st.sampled_from(self.sleep_levels), label="sleep level"))
        if not (slept and data.draw(st.booleans(), label="nap")):
            return
        for _ in range(data.draw(st.integers(0, 2), label="steps asleep")):
            self._step()
        if not (self.closed or self.dead):
            self.wake()
            self._step()

    def _sleep(self, level: int) -> bool:
        """Sleep at ``level``; False if the pipeline refused level 2, as one with no
        ``reload_weights`` must (the core then stays awake)."""
        active = {rid for rid, state in self.states.items() if state not in TERMINAL_STATES}
        try:
            self.core.sleep(level)
        except PipelineContractError:
            if level != 2 or callable(getattr(self.oracle.pipeline, "reload_weights", None)):
                raise
            assert not self.core.is_sleeping, "a refused sleep left the core asleep"
            self.reach.note("path: level 2 refused (no reload_weights)")
            return False
        for state in sorted({self.states[rid].name for rid in active}):
            self.reach.note(f"path: sleep with a {state} request")
        if self.queued:
            self.reach.note("path: sleep with a queued request")
        self.slept = active | self.queued
        assert self.core.state is EngineState.SLEEPING and self.core.is_sleeping
        self.reach.note(f"rule: sleep at level {level}")
        return True

    @precondition(lambda self: not self.closed and not self.dead and self.core.is_sleeping)
    @rule()
    def wake(self) -> None:
        """Wake: the next step takes everything that waited."""
        if self.core.queue_length:
            self.reach.note("path: woke with requests waiting")
        self.core.wake_up()
        assert not self.core.is_sleeping and self.core.state is EngineState.SERVING
        self.reach.note("rule: wake")

    @invariant()
    def asleep_is_asleep(self) -> None:
        """The core's state matches its trace; at level 2 no weight storage is held."""
        if self.closed or self.dead:
            return
        assert self.core.is_sleeping == (self.asleep_at is not None), (
            f"the core says sleeping={self.core.is_sleeping}; its trace says level {self.asleep_at}"
        )
        if self.asleep_at == 2:
            held: list[int] = self.core.collective_rpc("device_weight_bytes")
            assert not any(held), f"asleep at level 2, the workers hold {held} bytes of weights"

    def wake_for_the_end(self) -> None:
        """Wake a core left asleep, so that what waits for it runs to its end."""
        if self.core.is_sleeping:
            self.core.wake_up()
            self.reach.note("path: woken for the end")

    @property
    def _can_sleep(self) -> bool:
        return bool(self.sleep_levels) and not (self.closed or self.dead or self.core.is_sleeping)

    def _record(self, event: TraceEvent) -> None:
        super()._record(event)
        if isinstance(event, EngineEvent):
            self._follow_engine(event)
        elif isinstance(event, LifecycleEvent) and not event.rejected:
            self._note_lifecycle(event)

    def _follow_engine(self, event: EngineEvent) -> None:
        if event.state == "sleeping":
            self.asleep_at = int((event.reason or "").removeprefix("level "))
        elif event.state == "awake":
            self.asleep_at = None
        elif event.state == "closed" and self.asleep_at is not None:
            self.reach.note("path: closed while asleep")

    def _note_lifecycle(self, event: LifecycleEvent) -> None:
        rid = event.request_id
        if self.asleep_at is not None:
            if event.source is None:
                self.reach.note("path: admitted while asleep")
            elif event.dest is RequestStatus.FINISHED_ABORTED:
                assert event.source is not None
                self.reach.note(f"path: a {event.source.name} request aborted while asleep")
        if rid in self.slept and event.dest in TERMINAL_STATES:
            self.slept.discard(rid)
            if event.dest is RequestStatus.FINISHED_COMPLETED:
                self.reach.note("path: a request that slept completed")
