"""The front harness in lockstep: the harness drives the engine itself, one
:meth:`~diffusion_runtime.DiffusionEngine.run_once` at a time, so no draw and
no interleaving depends on thread timing.

A :class:`LockstepFront` is a :class:`~diffusion_runtime.DiffusionEngine`
built with ``background_loop=False``: nothing drives it but the harness, and
reading a stream drives it until the next output is there.
:class:`LockstepLifecycleMachine` adds to the front harness a rule that drives
the loop and a rule that races it: calls that a caller on another thread
could make while the loop runs (admit, abort, pause, resume) are made at an
event point inside the next drive (a request admitted, a wave chosen before
the workers run it, a request ended). Close races the loop between drives,
with requests and aborts queued and not taken yet. ``generate()`` with a
timeout shorter than any work (it drives the engine itself) must return, with
:class:`TimeoutError` or the output, paused or not.

:class:`PauseChecker` holds the engine to exact pause semantics:

- a step that began while paused chooses no wave (the pause is read with the
  take of the inbox, once);
- the first step that begins after ``resume()`` admits every request added
  before ``resume()`` returned before its first wave (no split);
- no request aborted while paused reaches a wave of that step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any, ClassVar

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import invariant, precondition, rule

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineSnapshot
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent
from diffusion_runtime.fsm.events import TraceEvent, WaveEvent
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.testing.fronts import FrontCapabilities, admit_while_held
from diffusion_runtime.testing.harness import EngineLifecycleMachine, lifecycle_machine

#: Drives in a row that change nothing before a reader is called stuck.
IDLE_DRIVES_LIMIT = 3
#: Event-loop turns a reader gets after a drive to take what it delivered.
TURNS_AFTER_A_DRIVE = 3
#: The most drives a quiet-down may take.
MAX_DRIVES_TO_QUIET = 500


@attrs.define
class PauseChecker:
    """Exact pause semantics, checked from the calls made and the events seen."""

    paused: bool = False
    #: Added (``add_request`` returned) and not admitted by the core yet.
    queued: set[str] = attrs.field(factory=set)
    aborted_while_paused: set[str] = attrs.field(factory=set)
    #: Set by ``resume()``: what the first step that begins after it must honour.
    resumed: tuple[frozenset[str], frozenset[str]] | None = None
    #: During a drive: whether it began paused, and what it must honour.
    began_paused: bool | None = None
    honours: tuple[frozenset[str], frozenset[str]] | None = None
    problems: list[str] = attrs.field(factory=list)

    def added(self, request_id: str) -> None:
        self.queued.add(request_id)

    def aborted(self, request_id: str) -> None:
        if self.paused:
            self.aborted_while_paused.add(request_id)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.resumed = (frozenset(self.queued), frozenset(self.aborted_while_paused))
            self.aborted_while_paused.clear()
        self.paused = False

    def drive_begins(self) -> None:
        self.began_paused = self.paused
        if not self.paused and self.resumed is not None:
            self.honours, self.resumed = self.resumed, None

    def drive_ends(self) -> None:
        self.began_paused = None
        self.honours = None

    def feed(self, event: TraceEvent) -> None:
        if isinstance(event, LifecycleEvent) and event.source is None and not event.rejected:
            self.queued.discard(event.request_id)
        elif isinstance(event, WaveEvent) and self.began_paused is not None:
            self._check_wave(event)

    def _check_wave(self, event: WaveEvent) -> None:
        if self.began_paused:
            self.problems.append(f"a step that began while paused chose wave {event.wave_id}")
        if self.honours is None:
            return
        must_admit, aborted = self.honours
        split = sorted(must_admit & self.queued)
        if split:
            self.problems.append(
                f"wave {event.wave_id}, the first after resume(), was chosen before the core "
                f"admitted {split}, added while paused"
            )
        ran = sorted(aborted & set(event.scheduled_ids))
        if ran:
            self.problems.append(f"{ran} aborted while paused, yet in wave {event.wave_id}")


class LockstepFront:
    """A :class:`DiffusionEngine` that only the harness drives (every capability
    but ``die``)."""

    capabilities = FrontCapabilities(
        pause=True, snapshot=True, live_events=True, die=False, held_messages_together=True
    )

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = DiffusionEngine.make_engine(config, background_loop=False)
        self._loop = loop
        self.checker = PauseChecker()
        #: Called with each event, after the checker saw it (a race's calls).
        self.on_event: Callable[[TraceEvent], None] | None = None
        self.engine.machine.subscribe(self._event)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def drive(self) -> bool:
        """One :meth:`DiffusionEngine.run_once`; whether it did anything."""
        self.checker.drive_begins()
        try:
            return self.engine.run_once()
        finally:
            self.checker.drive_ends()

    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> str:
        rid = await self.engine.add_request(prompt, params, request_id=request_id)
        self.checker.added(rid)
        return rid

    def add_together(self, requests: Sequence[tuple[Any, SamplingParams]]) -> list[str]:
        return admit_while_held(self, self._loop, requests, already_held=self.checker.paused)

    async def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream, driving the engine while the next output is not there."""
        reader = self.engine.stream(request_id)
        async with contextlib.aclosing(reader):
            while True:
                ahead = asyncio.ensure_future(anext(reader))
                try:
                    await self._drive_until(ahead, request_id)
                finally:  # the reader cannot close while a step of it is pending
                    if not ahead.done():
                        ahead.cancel()
                        await asyncio.gather(ahead, return_exceptions=True)
                try:
                    output = ahead.result()
                except StopAsyncIteration:
                    return
                yield output

    async def _drive_until(self, ahead: asyncio.Future[RequestOutput], request_id: str) -> None:
        idle = 0
        while True:
            for _ in range(TURNS_AFTER_A_DRIVE):
                await asyncio.sleep(0)
            if ahead.done():
                return
            if self.engine.is_closed:  # its end reaches the stream on a later turn
                idle += 1
            else:
                idle = 0 if self.drive() else idle + 1
            assert idle < IDLE_DRIVES_LIMIT, (
                f"{request_id!r}: the engine has nothing to do, yet its stream waits"
            )

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.checker.aborted(request_id)

    def pause(self) -> None:
        self.engine.pause()
        self.checker.pause()

    def resume(self) -> None:
        self.engine.resume()
        self.checker.resume()

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def generate_alone(self, prompt: Any, params: SamplingParams, timeout: float) -> RequestOutput:
        [output] = self.engine.generate([prompt], params, timeout=timeout)
        return output

    def wait_until_quiet(self, timeout: float) -> None:
        for _ in range(MAX_DRIVES_TO_QUIET):
            if not (self.engine.queue_length or self.engine.snapshot().scheduler_ids):
                return
            self.drive()
        raise AssertionError(f"the engine was not quiet after {MAX_DRIVES_TO_QUIET} drives")

    def kill(self) -> None:
        raise RuntimeError("a lockstep front has no worker killer (capabilities.die)")

    def close(self) -> None:
        self.engine.close()

    def subscribe(self, subscriber: Callable[[TraceEvent], None]) -> None:
        self.engine.machine.subscribe(subscriber)

    def recorded_events(self) -> Iterable[TraceEvent]:
        return ()

    def left_behind(self) -> list[str]:
        return []  # no thread of its own; the engine's tests check its workers

    def _event(self, event: TraceEvent) -> None:
        self.checker.feed(event)
        if self.on_event is not None:
            self.on_event(event)


class LockstepLifecycleMachine(EngineLifecycleMachine):
    """The front harness over a :class:`LockstepFront`, with rules that drive the
    loop and race it; configure it with :func:`lockstep_machine`."""

    front: LockstepFront
    #: Race actions whose precondition holds, by name.
    race_actions: ClassVar[tuple[str, ...]] = ("add", "abort", "pause", "resume")

    @invariant()
    def pause_is_exact(self) -> None:
        assert not self.front.checker.problems, self.front.checker.problems[0]

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def drive(self, data: st.DataObject) -> None:
        """Let the loop run a few steps."""
        for _ in range(data.draw(st.integers(1, 3), label="drives")):
            self.front.drive()

    @precondition(
        lambda self: not self.closed and not self.paused and self.front.engine.queue_length > 0
    )
    @rule(data=st.data())
    def race_an_admission(self, data: st.DataObject) -> None:
        """Calls made while the core admits a queued request."""
        self._race("admission", data)

    @precondition(lambda self: not self.closed and not self.paused and self._has_work())
    @rule(data=st.data())
    def race_a_wave(self, data: st.DataObject) -> None:
        """Calls made once a wave is chosen, before the workers run it."""
        self._race("wave", data)

    @precondition(lambda self: not self.closed and self._has_work())
    @rule(data=st.data())
    def race_an_end(self, data: st.DataObject) -> None:
        """Calls made as a request reaches its terminal state."""
        self._race("end", data)

    @precondition(lambda self: self.paused and self.front.engine.queue_length > 0)
    @rule()
    def resume_during_a_paused_step(self) -> None:
        """resume() lands while a step that began paused runs: at its first
        admission if it makes one (it must not), else right after it. Either way
        the step chooses no wave, and the next one takes everything queued."""
        resumed = False

        def at_admission(event: TraceEvent) -> None:
            nonlocal resumed
            if not resumed and _is_point(event, "admission"):
                resumed = True
                self.reach.note("path: a paused step admitted a request")
                self._note_resume()
                EngineLifecycleMachine.resume(self)

        self.front.on_event = at_admission
        try:
            self.front.drive()
        finally:
            self.front.on_event = None
        if not resumed:
            self.resume()

    def _has_work(self) -> bool:
        return bool(self.front.engine.queue_length or self.front.snapshot().scheduler_ids)

    def _race(self, point: str, data: st.DataObject) -> None:
        """Calls another thread could make while the loop runs, made at the first
        ``point`` event inside the next drives (up to four)."""
        count = data.draw(st.integers(1, 3), label="calls")
        fired = False

        def at_point(event: TraceEvent) -> None:
            nonlocal fired
            if fired or not _is_point(event, point):
                return
            fired = True
            self.front.on_event = None
            self.reach.note(f"path: raced at {point}")
            for _ in range(count):
                self._race_call(data)

        self.front.on_event = at_point
        try:
            for _ in range(data.draw(st.integers(1, 4), label="drives")):
                self.front.drive()
                if fired or self.closed:
                    break
        finally:
            self.front.on_event = None

    def _race_call(self, data: st.DataObject) -> None:
        choices = [a for a in self.race_actions if self._may(a)]
        action = data.draw(st.sampled_from(choices), label="raced call")
        self.reach.note(f"rule: raced {action}")
        if action == "add":
            self._add(data.draw(self.prompts), data.draw(self.params))
        elif action == "abort":
            self.front.abort(data.draw(st.sampled_from(sorted(self.inputs)), label="aborted id"))
        elif action == "pause":
            self.pause()
        else:
            self._note_resume()
            EngineLifecycleMachine.resume(self)  # no drive: this is inside one

    def _may(self, action: str) -> bool:
        if action == "abort":
            return bool(self.inputs)
        if action == "pause":
            return not self.paused
        if action == "resume":
            return self.paused
        return True

    @precondition(lambda self: not self.closed and (self.paused or not self._has_work()))
    @rule(data=st.data())
    def generate_past_its_timeout(self, data: st.DataObject) -> None:
        """``generate(timeout=t)`` with ``t`` shorter than any work: it drives the
        engine itself and must return (:class:`TimeoutError`, or the output if the
        work beat the clock) within the read timeout, paused or not; a timed-out
        request is aborted, and the engine serves on.

        Whether the work beats the clock depends on timing, so the call is made
        only where its outcome cannot steer later draws: on a quiet engine (the
        call runs its own request to its end either way) or a paused one (no
        step runs; the request and its abort wait for ``resume()``)."""
        prompt, params = data.draw(self.prompts), data.draw(self.params)
        timeout = data.draw(st.sampled_from([1e-4, 1e-3]), label="timeout")
        outcome: list[BaseException | RequestOutput] = []

        def call() -> None:
            try:
                outcome.append(self.front.generate_alone(prompt, params, timeout))
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call, name="harness-generate", daemon=True)
        caller.start()
        caller.join(self.read_timeout_s)
        if caller.is_alive():  # closing wakes it, so the example can end
            self.closed = True
            self.front.close()
            caller.join(self.read_timeout_s)
            raise AssertionError(
                f"generate(timeout={timeout}) had not returned after {self.read_timeout_s} s"
            )
        [result] = outcome
        if isinstance(result, TimeoutError):
            self.reach.note("path: generate timed out" + (" while paused" if self.paused else ""))
        elif isinstance(result, RequestOutput):
            self.reach.note("path: generate beat its timeout")
        else:
            raise result

    @precondition(lambda self: self.paused)
    @rule(rid=EngineLifecycleMachine.requests)
    def abort_while_paused(self, rid: str) -> None:
        """An abort queued while paused: it applies before any wave after resume()."""
        self.front.abort(rid)

    @precondition(lambda self: self.paused)
    @rule()
    def resume(self) -> None:
        """Resume, then let one step run: it must take everything queued meanwhile."""
        self._note_resume()
        super().resume()
        if not self.closed:
            self.front.drive()

    def _note_resume(self) -> None:
        if self.front.checker.queued:
            self.reach.note("path: resumed with requests queued")
        if self.front.checker.aborted_while_paused:
            self.reach.note("path: resumed with aborts queued")


def _is_point(event: TraceEvent, point: str) -> bool:
    if point == "wave":
        return isinstance(event, WaveEvent) and bool(event.scheduled_ids)
    if not isinstance(event, LifecycleEvent) or event.rejected:
        return False
    if point == "admission":
        return event.source is None
    return event.dest in TERMINAL_STATES


def lockstep_machine(
    config: Callable[[], EngineConfig], **options: Any
) -> type[LockstepLifecycleMachine]:
    """A lockstep front harness for engines built from ``config()``; ``options`` as
    for :func:`~diffusion_runtime.testing.harness.lifecycle_machine`, less the
    engine's own components and the worker killer."""
    machine = lifecycle_machine(
        config, front=LockstepFront, base=LockstepLifecycleMachine, **options
    )
    return machine  # type: ignore[return-value]


__all__ = [
    "LockstepFront",
    "LockstepLifecycleMachine",
    "PauseChecker",
    "lockstep_machine",
]
