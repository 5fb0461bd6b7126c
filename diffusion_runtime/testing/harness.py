"""A stateful property test of the lifecycle, cleanup and identity invariants,
pointed at any engine configuration: your pipeline, executor or scheduler.

Hypothesis drives a real front (a :class:`DiffusionEngine`, or with
``target="stage"`` a :class:`~diffusion_runtime.stage.StageClient` and its
stage process) through add / add a duplicate id / abort / drop a consumer /
inject a failure / pause and resume the loop (so requests pile up into
batches) / kill a worker / close (and, on a front with batch requests, add a
batch of prompts as one parent request), in random order, with the auditor
attached to every event. After every step it checks the auditor found nothing and
that no state is left for finished requests; at the end, that every admitted
request reached exactly one terminal state, and that every completed output
equals the pipeline's own output for it, called directly (the checks of
:class:`~diffusion_runtime.testing.harness_root.HarnessRoot`, the root
every harness shares). What a front cannot offer (see
:class:`~diffusion_runtime.testing.fronts.FrontCapabilities`) switches the
rules and checks that need it off.

A user's test file can be two lines::

    from diffusion_runtime.testing import lifecycle_test_case
    TestMyPipeline = lifecycle_test_case(lambda: EngineConfig(pipeline="mypkg:MyPipeline"))
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import unittest
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import hypothesis.strategies as st
import torch
from hypothesis import settings as Settings
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    invariant,
    multiple,
    precondition,
    rule,
)

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
)
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent, RequestStatus
from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.testing.core_harness import core_lifecycle_machine
from diffusion_runtime.testing.fronts import BatchFront, EngineFront, HarnessFront
from diffusion_runtime.testing.harness_root import HarnessRoot, configured
from diffusion_runtime.testing.replay import replayable_test_case
from diffusion_runtime.testing.stage_front import StageFront

#: Where a failing ``lifecycle_test_case`` writes its replay file unless told otherwise.
DEFAULT_REPLAY_DIR = Path(tempfile.gettempdir()) / "diffusion-runtime-replays"

#: Builds the front under test from a config, on the harness's event loop.
FrontFactory = Callable[[EngineConfig, asyncio.AbstractEventLoop], HarnessFront]

#: The reason of a caller's abort (the front's default).
CALLER_ABORT_REASON = "aborted by the caller"
#: A batch parent ended by a child names it: ``"prompt <index>: <why>"``.
CHILD_REASON = re.compile(r"prompt (\d+): ")


@attrs.frozen
class BatchRun:
    """A batch request the harness made, and its parent's final output."""

    request_id: str
    prompts: tuple[Any, ...]
    params: SamplingParams
    child_ids: tuple[str, ...]
    output: RequestOutput
    #: The caller aborted the parent while it was active.
    aborted_active: bool


class EngineLifecycleMachine(HarnessRoot):
    """The harness; configure it with :func:`lifecycle_machine` or subclass it.

    Override :meth:`build_engine` to keep a handle on the pipeline you pass
    in, and add rules or invariants of your own in a subclass. With a
    ``front_factory`` it drives that front instead of a :class:`DiffusionEngine`.
    """

    # A tuple, so the function is not bound as a method of the machine.
    worker_killer: ClassVar[tuple[Callable[[DiffusionEngine], None], ...]] = ()
    #: Whether completed outputs are compared with the pipeline called directly.
    check_oracle: ClassVar[bool] = True
    read_timeout_s: ClassVar[float] = 30.0
    # A tuple, so the factory is not bound as a method of the machine.
    front_factory: ClassVar[tuple[FrontFactory, ...]] = ()

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.lifecycle: list[LifecycleEvent] = []
        self.inputs: dict[str, tuple[Any, SamplingParams]] = {}
        self.unread: set[str] = set()
        self.outputs: dict[str, RequestOutput] = {}
        self.closed = False
        self.killed = False
        self.paused = False
        #: Ids whose consumer left while they were active, with that admission's number.
        self.must_abort: dict[str, int] = {}
        self.batches: list[BatchRun] = []
        self.front = self.build_front()
        self.config = self.front.config
        if self.front.capabilities.live_events:
            self.front.subscribe(self._record)

    def build_front(self) -> HarnessFront:
        """The front under test (a fresh one for every example): the ``front_factory``'s,
        or an :class:`EngineFront` over :meth:`build_engine`."""
        if self.front_factory:
            return self.front_factory[0](type(self).config_factory(), self.loop)
        self.engine = self.build_engine()
        killer = self.worker_killer[0] if self.worker_killer else None
        return EngineFront(self.engine, self.loop, killer)

    def build_engine(self) -> DiffusionEngine:
        """The engine under test, without a ``front_factory``."""
        config = type(self).config_factory()
        executor = self.executor_cls(config) if self.executor_cls is not None else None
        return DiffusionEngine.make_engine(
            config, scheduler_cls=self.scheduler_cls, executor=executor
        )

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: not self.closed and not self.killed)
    @rule(target=requests, data=st.data())
    def add(self, data: st.DataObject) -> str:
        return self._add(data.draw(self.prompts), data.draw(self.params))

    @precondition(lambda self: not self.closed and not self.killed)
    @rule(target=requests, data=st.data())
    def add_burst(self, data: st.DataObject) -> MultipleResults[str]:
        """Several requests admitted while the loop is held, so they share waves or steps."""
        mix = data.draw(st.lists(st.tuples(self.prompts, self.params), min_size=2, max_size=4))
        ids = self.front.add_together(mix)
        for rid, (prompt, params) in zip(ids, mix, strict=True):
            self._admitted(rid, prompt, params)
        return multiple(*ids)

    @precondition(
        lambda self: not self.closed and not self.killed and self.failing_prompts is not None
    )
    @rule(target=requests, data=st.data())
    def add_failing(self, data: st.DataObject) -> str:
        assert self.failing_prompts is not None
        return self._add(data.draw(self.failing_prompts), data.draw(self.params))

    @precondition(lambda self: self._can_hold())
    @rule(target=requests, data=st.data())
    def abort_before_it_runs(self, data: st.DataObject) -> str:
        """A request aborted while the loop is held, before it could run (by the
        caller, or by its consumer leaving), ends ABORTED; a caller's abort ends
        its stream with that final output.

        Where messages sent while held may arrive after the release
        (``held_messages_together`` off), the abort may come after a step, so
        only the final output is required; INV-008 judges the abort's effect.
        """
        prompt, params = data.draw(self.prompts), data.draw(self.params)
        by_consumer = data.draw(st.booleans())
        self.front.pause()
        rid = self._add(prompt, params)
        if by_consumer:
            self.unread.discard(rid)
            ran = self._run(self._read_then_leave(rid))
            if self.front.capabilities.held_messages_together:
                assert not ran, f"{rid!r}: its final output came while the loop was held"
                self.must_abort[rid] = 1  # its first admission, made at the release
            self.reach.note("path: consumer dropped while its request was active")
            self.front.resume()
            return rid
        self.front.abort(rid)
        self.front.resume()
        self._run(self._read(rid))
        self.unread.discard(rid)
        final = self.outputs.get(rid)
        assert final is not None and final.finished, f"{rid!r}: no final output after its abort"
        if final.status is RequestStatus.FINISHED_ABORTED:
            self.reach.note("path: aborted before it ran")
        else:
            assert not self.front.capabilities.held_messages_together, (
                f"{rid!r}: aborted before it could run, yet ended {final.status}"
            )
        return rid

    def _can_batch(self) -> bool:
        """Whether a batch rule may run: the front has batches, and is open and not held."""
        over = self.closed or self.killed or self.paused
        return self.front.capabilities.batches and not over

    @precondition(_can_batch)
    @rule(data=st.data())
    def add_batch(self, data: st.DataObject) -> None:
        """Two or three prompts (good ones, or half the time good and failing ones)
        as one batch request: a parent over a child per prompt.

        The parent's one final output comes only once every child has ended
        (no child is left unfinished in the front); it holds every child's
        images (``num_outputs_per_prompt`` each) if it completed, none
        otherwise. Its status against its children's (read from the trace) is
        checked at teardown (:meth:`_check_batches`), its images against each
        prompt run alone with the solo runs.
        """
        front = self._batch_front()
        prompts, params, rid = self._draw_batch(data)
        self._end_batch(rid, prompts, params, front.add_batch(prompts, params, rid), False)

    @precondition(_can_batch)
    @rule(data=st.data())
    def abort_batch_before_admission(self, data: st.DataObject) -> None:
        """A batch sent while the loop is held and aborted by the caller before its
        children are admitted: it ends ABORTED with the caller's reason, once its
        children (admitted and aborted at the release) have ended."""
        front = self._batch_front()
        prompts, params, rid = self._draw_batch(data)
        front.pause()
        batch = self.loop.create_task(front.add_batch(prompts, params, rid))
        self.loop.run_until_complete(front.batch_sent(rid))
        if batch.done():  # refused before it was sent
            batch.result()
        active = front.abort_batch(rid)
        front.resume()
        assert active, f"{rid!r}: the parent ended before the stage admitted its children"
        self.reach.note("path: a batch parent aborted before its children were admitted")
        self._end_batch(rid, prompts, params, batch, active)

    @precondition(_can_batch)
    @rule(data=st.data())
    def abort_running_batch(self, data: st.DataObject) -> None:
        """A batch aborted by the caller once its children are admitted: if it was
        still active then, it ends ABORTED with the caller's reason, whatever its
        children do (whether it still was depends on timing; no draw does)."""
        front = self._batch_front()
        prompts, params, rid = self._draw_batch(data)
        batch = self.loop.create_task(front.add_batch(prompts, params, rid))
        started = self.loop.create_task(front.batch_started(rid))
        self._run(asyncio.wait({batch, started}, return_when=asyncio.FIRST_COMPLETED))
        started.cancel()
        self.loop.run_until_complete(asyncio.gather(started, return_exceptions=True))
        active = front.abort_batch(rid)
        if active:
            self.reach.note("path: a RUNNING batch parent aborted")
        self._end_batch(rid, prompts, params, batch, active)

    def _draw_batch(self, data: st.DataObject) -> tuple[tuple[Any, ...], SamplingParams, str]:
        """A batch's prompts (failing ones mixed in half the time), params and id."""
        mix = self.prompts
        if self.failing_prompts is not None and data.draw(st.booleans()):
            mix = st.one_of(self.prompts, self.failing_prompts)
        prompts = tuple(data.draw(st.lists(mix, min_size=2, max_size=3)))
        self.reach.note("rule: batch of prompts")
        return prompts, data.draw(self.params), f"batch-{len(self.batches)}"

    def _end_batch(
        self,
        rid: str,
        prompts: tuple[Any, ...],
        params: SamplingParams,
        batch: Awaitable[RequestOutput],
        aborted_active: bool,
    ) -> None:
        """Wait for the batch's final output and check it (:meth:`_check_batch_output`)."""
        front = self._batch_front()
        output: RequestOutput = self._run(batch)
        children = tuple(front.child_ids(rid, len(prompts)))
        run = BatchRun(rid, prompts, params, children, output, aborted_active)
        self.batches.append(run)
        self._check_batch_output(run, front.unfinished_ids())
        if output.status is RequestStatus.FINISHED_ERROR:
            self.reach.note("path: a batch parent with a failing child")
        elif output.status is RequestStatus.FINISHED_COMPLETED:
            self.reach.note("path: a batch parent completed")

    @precondition(lambda self: not self.closed and not self.killed and not self.paused)
    @rule(rid=requests)
    def add_with_a_taken_id(self, rid: str) -> None:
        """Reusing an id is refused while its output is unread, and allowed once
        its request has finished and been read.

        It runs on a quiet engine, so whether the id is free never depends on timing.
        """
        prompt, params = self.inputs[rid]
        self.front.wait_until_quiet(self.read_timeout_s)
        free = rid not in self.unread
        admissions = sum(1 for e in self._events_of(rid) if e.source is None)
        try:
            self.loop.run_until_complete(self.front.add_request(prompt, params, request_id=rid))
        except DuplicateRequestError:
            assert not free, f"{rid!r} refused after it finished and was read"
            return
        assert free, f"{rid!r} admitted again while its output was unread"
        if self.front.capabilities.live_events:  # else INV-001 judges it from the trace
            self._assert_ended_before_readmission(rid, admissions)
        # A new lifecycle under an old id: its output replaces the old one's.
        self.outputs.pop(rid, None)
        self._run(self._read(rid))

    def _assert_ended_before_readmission(self, rid: str, admissions: int) -> None:
        """The old lifecycle (before the new admission, which the engine's driver
        makes later) must have ended before the id was accepted again."""
        events = self._events_of(rid)
        starts = [i for i, e in enumerate(events) if e.source is None]
        end = starts[admissions] if len(starts) > admissions else len(events)
        old = events[starts[admissions - 1] : end] if admissions else []
        assert old and old[-1].dest.is_finished, f"{rid!r} admitted while active"

    @rule(rid=requests)
    def abort(self, rid: str) -> None:
        self.front.abort(rid)

    @precondition(lambda self: self._can_hold())
    @rule()
    def pause(self) -> None:
        """Hold the loop between ticks so requests and aborts pile up."""
        self.front.pause()
        self.paused = True

    @precondition(lambda self: self.paused)
    @rule()
    def resume(self) -> None:
        self.front.resume()
        self.paused = False

    @precondition(lambda self: self.unread and not self.closed and not self.killed)
    @rule(data=st.data())
    def drop_consumer(self, data: st.DataObject) -> None:
        """A consumer leaves; if it left while the loop was held and its request was
        active, the request must end ABORTED once the loop runs again.

        A front whose loop cannot be held, or that cannot say at once which
        requests are active (no snapshot or no live events), leaves the effect
        to the auditor (INV-008).
        """
        rid = data.draw(st.sampled_from(sorted(self.unread)))
        self.unread.discard(rid)
        capabilities = self.front.capabilities
        if not (capabilities.pause and capabilities.snapshot and capabilities.live_events):
            if not self._run(self._read_then_leave(rid)):
                self.reach.note("path: consumer dropped before its final output")
            return
        held = not self.paused
        if held:
            self.front.pause()
        self.front.snapshot()  # runs between two steps: no wave is in flight after it
        events = self._events_of(rid)
        if events and not events[-1].dest.is_finished:
            self.must_abort[rid] = len([e for e in events if e.source is None])
            self.reach.note("path: consumer dropped while its request was active")
        self._run(self._read_then_leave(rid))
        if held:
            self.front.resume()

    @precondition(lambda self: self.unread and not self.closed and not self.killed)
    @rule()
    def close_with_blocked_readers(self) -> None:
        """Readers wait on their streams when close() runs: each must end."""
        self.closed = True
        if self._end_with_readers_waiting(self.front.close):
            self.reach.note("path: close with blocked readers")

    @precondition(lambda self: not self.paused)
    @rule()
    def read_all(self) -> None:
        for rid in sorted(self.unread):
            self._run(self._read(rid))
        self.unread.clear()

    @precondition(lambda self: self.front.capabilities.die and not self.closed and not self.killed)
    @rule(data=st.data())
    def kill_worker(self, data: st.DataObject) -> None:
        """Admit requests while the loop is held, then kill a worker (or the stage)
        with readers waiting on every unread stream: each stream must end."""
        mix = data.draw(st.lists(st.tuples(self.prompts, self.params), min_size=1, max_size=3))
        if self.front.capabilities.pause and not self.paused:
            self.pause()
        for prompt, params in mix:
            self._add(prompt, params)

        def die() -> None:
            self.front.kill()
            if self.paused:
                self.resume()  # the loop runs on, and meets the death

        self.killed = True
        if self._end_with_readers_waiting(die):
            self.reach.note("path: death with blocked readers")

    @precondition(lambda self: not self.closed and len(self.inputs) >= 3)
    @rule()
    def close(self) -> None:
        self.closed = True
        self.front.close()

    # -- invariants --------------------------------------------------------------------

    @precondition(lambda self: self.front.capabilities.snapshot)
    @invariant()
    def nothing_is_left_for_finished_requests(self) -> None:
        if self.killed:
            return
        finished = self._finished_ids()
        snapshot = self.front.snapshot()
        if self.closed:
            assert not snapshot.scheduler_ids and not snapshot.running_ids
            return
        preempted = {e.request_id for e in self.lifecycle if e.dest is RequestStatus.PREEMPTED}
        step_mode = self.front.config.resolved_mode == "step"
        self.check_nothing_held(snapshot, finished, preempted - finished, step_mode)
        # Every batch rule waits for its parent's final output: none is left active.
        assert not snapshot.group_ids, f"grouped requests held after their end: {snapshot}"

    def _can_hold(self) -> bool:
        """Whether a rule may hold the loop now: the front can, and it is not held or over."""
        over = self.closed or self.killed
        return self.front.capabilities.pause and not self.paused and not over

    def teardown(self) -> None:
        try:
            if self.paused:
                self.resume()
            if not self.closed and not self.killed:
                self.read_all()
                if self.check_oracle:
                    self._check_against_the_pipeline()
                    self._check_batches_against_the_pipeline()
            self.front.close()
            for event in self.front.recorded_events():  # the events no subscriber saw live
                self._record(event)
            self._check_final_states()
            self._check_batches()
            left = self.front.left_behind()
            assert not left, f"left behind after close: {left}"
        finally:
            self.front.close()
            self.loop.close()

    # -- checks ------------------------------------------------------------------------

    def _check_final_states(self) -> None:
        for rid, admission in self.must_abort.items():
            ends = [e for e in self._events_of(rid) if e.dest in TERMINAL_STATES]
            if len(ends) >= admission and not self.killed:
                end = ends[admission - 1]
                assert end.dest is RequestStatus.FINISHED_ABORTED, (
                    f"{rid!r}: its consumer left while it was active, yet it ended {end.dest} "
                    f"(its transitions: {[e.trigger for e in self._events_of(rid)]})"
                )
        for out in self.outputs.values():
            if out.ok:
                self.check_image_count(out, self.inputs[out.request_id][1])
        self.check_trace_ended(may_have_died=self.killed)

    def _check_against_the_pipeline(self) -> None:
        """Every completed output equals the pipeline's own output for its request."""
        for rid, out in sorted(self.outputs.items()):
            if out.ok:
                assert out.seed is not None, f"{rid!r}: a completed output without its seed"
                prompt, params = self.inputs[rid]
                self.check_against_the_pipeline(out, prompt, params, out.seed)

    def _check_batch_output(self, run: BatchRun, unfinished: frozenset[str]) -> None:
        """A batch parent's final output, as it reaches the caller: after every child
        ended, with every child's images if it completed (none otherwise)."""
        output = run.output
        assert output.request_id == run.request_id and output.finished, output
        held = sorted(set(run.child_ids) & unfinished)
        assert not held, f"{run.request_id!r}: its output came before its children {held} ended"
        if output.status is RequestStatus.FINISHED_COMPLETED:
            count = len(run.child_ids) * run.params.num_outputs_per_prompt
            produced = output.image_batch if run.params.decodes else output.latents
            got = None if produced is None else produced.shape[0]
            what = "images" if run.params.decodes else "latents"
            assert got == count and output.error is None, (
                f"{run.request_id!r}: completed with {got} {what}, its children made {count}"
            )
        else:
            products = (output.image_batch, output.latents, output.trajectory)
            assert products == (None, None, None) and output.error, output
        if run.aborted_active:
            assert output.status is RequestStatus.FINISHED_ABORTED, output
            assert output.error == CALLER_ABORT_REASON, output

    def _check_batches(self) -> None:
        """Each batch parent made exactly one terminal transition, to its output's
        status, and that status is its children's (from the trace): COMPLETED if
        and only if every child completed; else, unless the caller aborted it
        while active, the status of the child its error names (the first child
        to end without completing: ERROR fails the parent, ABORTED aborts it)."""
        if not self.batches:
            return
        ends: dict[str, RequestStatus] = {}
        for event in self.lifecycle:
            if event.dest in TERMINAL_STATES:
                ends.setdefault(event.request_id, event.dest)
        parent_events = self._batch_front().batch_events()
        for run in self.batches:
            mine = [e for e in parent_events if e.request_id == run.request_id]
            assert not any(e.rejected for e in mine), f"{run.request_id!r}: {mine}"
            terminal = [e.dest for e in mine if e.dest in TERMINAL_STATES]
            assert terminal == [run.output.status], (
                f"{run.request_id!r}: its parent's terminal transitions {terminal}, "
                f"its output {run.output.status}"
            )
            children = [ends.get(child) for child in run.child_ids]
            assert None not in children, f"{run.request_id!r}: a child never ended: {children}"
            if run.aborted_active:
                continue
            completed = all(c is RequestStatus.FINISHED_COMPLETED for c in children)
            if completed:
                assert run.output.status is RequestStatus.FINISHED_COMPLETED, (
                    f"{run.request_id!r}: every child completed, yet it ended {run.output.status}"
                )
                continue
            named = CHILD_REASON.match(run.output.error or "")
            assert named is not None, (
                f"{run.request_id!r}: children {children}, yet it ended {run.output.status} "
                f"({run.output.error!r})"
            )
            child = children[int(named.group(1))]
            assert child is not RequestStatus.FINISHED_COMPLETED and child is run.output.status, (
                f"{run.request_id!r}: ended {run.output.status} by prompt {named.group(1)}, "
                f"which ended {child} (children: {children})"
            )

    def _check_batches_against_the_pipeline(self) -> None:
        """Each completed batch's output, prompt by prompt (its images or latents and
        its part of the trajectory), equals the pipeline's own output for that
        prompt (every child runs with the parent's seed)."""
        for run in self.batches:
            output = run.output
            if output.status is not RequestStatus.FINISHED_COMPLETED:
                continue
            count = run.params.num_outputs_per_prompt
            if output.trajectory is not None:
                self.reach.note("output: a batch parent's merged trajectory")
            if output.latents is not None:
                self.reach.note("output: a batch parent's merged latents")
            for index, prompt in enumerate(run.prompts):
                part = _prompts_part(output, index, count)
                self.check_against_the_pipeline(part, prompt, run.params, output.seed)

    def _batch_front(self) -> BatchFront:
        assert isinstance(self.front, BatchFront), "a front with capabilities.batches"
        return self.front

    # -- helpers -----------------------------------------------------------------------

    def _add(self, prompt: Any, params: SamplingParams) -> str:
        rid = self.loop.run_until_complete(self.front.add_request(prompt, params))
        self._admitted(rid, prompt, params)
        return rid

    def _admitted(self, rid: str, prompt: Any, params: SamplingParams) -> None:
        self.inputs[rid] = (prompt, params)
        self.unread.add(rid)

    def _end_with_readers_waiting(self, end: Callable[[], None]) -> bool:
        """Start a reader on every unread stream, run ``end`` (close or kill) and
        require every reader to finish; return whether any was blocked."""
        readers = {rid: self.loop.create_task(self._read(rid)) for rid in sorted(self.unread)}
        self.unread.clear()
        self.loop.run_until_complete(asyncio.sleep(0))  # each reader runs up to its first wait
        blocked = any(not task.done() for task in readers.values())
        end()
        if not readers:
            return blocked
        done, pending = self.loop.run_until_complete(
            asyncio.wait(readers.values(), timeout=self.read_timeout_s)
        )
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        assert not pending, f"streams still open after close or death: {sorted(readers)}"
        for task in done:
            task.result()
        return blocked

    def _record(self, event: TraceEvent) -> None:
        super()._record(event)
        if isinstance(event, LifecycleEvent) and not event.rejected:
            self.lifecycle.append(event)

    def _finished_ids(self) -> set[str]:
        state: dict[str, bool] = {}
        for event in self.lifecycle:
            state[event.request_id] = event.dest in TERMINAL_STATES
        return {rid for rid, finished in state.items() if finished}

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, self.read_timeout_s))

    async def _read(self, rid: str) -> None:
        try:
            async for out in self.front.stream(rid):
                self.outputs[rid] = out
        except EngineClosedError:
            assert self.closed, "a stream ended with EngineClosedError while the engine was open"
        except EngineDeadError:
            assert self.killed, "the engine died, but no worker was killed"

    def _events_of(self, rid: str) -> list[LifecycleEvent]:
        return [e for e in list(self.lifecycle) if e.request_id == rid and not e.rejected]

    async def _read_then_leave(self, rid: str) -> bool:
        """Read what is ready of ``rid``'s stream, then leave; return whether its
        final output was among it."""
        reader = self.front.stream(rid)
        step = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)
        final = False
        if step.done():
            if step.exception() is None:
                self.outputs[rid] = step.result()
                final = self.outputs[rid].finished
        else:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await reader.aclose()
        return final


def lifecycle_machine(
    config: Callable[[], EngineConfig],
    *,
    prompts: st.SearchStrategy[Any] | None = None,
    params: st.SearchStrategy[SamplingParams] | None = None,
    failing_prompts: st.SearchStrategy[Any] | None = None,
    worker_killer: Callable[[DiffusionEngine], None] | None = None,
    check_oracle: bool = True,
    oracle_tolerance: float = 0.0,
    scheduler_cls: type[BaseScheduler] | None = None,
    executor_cls: type[DiffusionExecutor] | None = None,
    read_timeout_s: float | None = None,
    front: FrontFactory | None = None,
    base: type[EngineLifecycleMachine] = EngineLifecycleMachine,
) -> type[EngineLifecycleMachine]:
    """A front harness class for engines built from ``config()``.

    ``prompts`` and ``params`` generate valid requests; ``failing_prompts``
    generates requests the pipeline is known to fail on; ``worker_killer``
    kills a worker of a multi-process engine; ``check_oracle`` compares
    each completed output with the pipeline called directly, within
    ``oracle_tolerance`` (absolute); ``scheduler_cls`` and
    ``executor_cls`` plug in your own components; ``read_timeout_s`` bounds
    every wait for a stream; ``front`` builds another front than a
    :class:`DiffusionEngine` from the config (such as
    :class:`~diffusion_runtime.testing.stage_front.StageFront`), which then
    takes none of the engine's own components.
    """
    if front is not None:
        for field, component in (
            ("worker_killer", worker_killer),
            ("scheduler_cls", scheduler_cls),
            ("executor_cls", executor_cls),
        ):
            if component is not None:
                rule = "must be None with a front other than the engine (it builds its own)"
                raise InvalidFieldError("lifecycle_machine", field, rule, component)
    return configured(
        base,
        "ConfiguredLifecycle",
        config,
        prompts=prompts,
        params=params,
        failing_prompts=failing_prompts,
        worker_killer=(worker_killer,) if worker_killer else None,
        check_oracle=check_oracle,
        oracle_tolerance=oracle_tolerance,
        scheduler_cls=scheduler_cls,
        executor_cls=executor_cls,
        read_timeout_s=read_timeout_s,
        front_factory=(front,) if front else None,
    )


#: The harness targets :func:`lifecycle_test_case` accepts.
TARGETS = ("core", "front", "stage")


def lifecycle_test_case(
    config: Callable[[], EngineConfig],
    *,
    target: str = "core",
    settings: Settings | None = None,
    replay_dir: Path | None = None,
    **options: Any,
) -> type[unittest.TestCase]:
    """A ``unittest``/pytest test case running a harness over engines built from ``config()``.

    ``target="core"`` (the default) drives an engine core step by step,
    deterministically (options: ``core_lifecycle_machine``).
    ``target="front"`` drives a :class:`DiffusionEngine` through its
    async API and threads (options: :func:`lifecycle_machine`);
    ``target="stage"`` drives a :class:`~diffusion_runtime.stage.StageClient`
    and its stage process the same way, auditing the stage's trace once it
    has shut down (the same options, less the engine's own components;
    ``config()`` must be spawnable, see ``docs/stage.md``). On every target a
    failure writes a replay file (in ``replay_dir``, by default the temporary
    directory's ``diffusion-runtime-replays``) that ``diffusion-runtime audit
    --replay`` reruns.
    """
    machine: type[HarnessRoot]
    if target == "core":
        machine = core_lifecycle_machine(config, **options)
    elif target == "front":
        machine = lifecycle_machine(config, **options)
    elif target == "stage":
        machine = lifecycle_machine(config, front=StageFront, **options)
    else:
        raise InvalidFieldError(
            "lifecycle_test_case", "target", f"must be one of {TARGETS}", target
        )
    # Named after the caller's module, as namedtuple does, so a replay finds it there.
    module = sys._getframe(1).f_globals.get("__name__", "__main__")
    case = replayable_test_case(machine, module, replay_dir or DEFAULT_REPLAY_DIR)
    if settings is not None:
        case.settings = settings  # type: ignore[attr-defined]
    return case


def _prompts_part(output: RequestOutput, index: int, count: int) -> RequestOutput:
    """Prompt ``index``'s part of a batch parent's output, ``count`` rows per prompt,
    named as its child."""
    rows = slice(index * count, (index + 1) * count)

    def part(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[rows]

    trajectory = output.trajectory
    if trajectory is not None:
        log_probs = trajectory.log_probs
        trajectory = attrs.evolve(
            trajectory,
            latents=trajectory.latents[:, rows],
            log_probs=None if log_probs is None else log_probs[:, rows],
        )
    return attrs.evolve(
        output,
        request_id=f"{output.request_id}/{index}",
        image_batch=part(output.image_batch),
        latents=part(output.latents),
        trajectory=trajectory,
    )
