"""The deterministic lifecycle harness: hypothesis drives an :class:`EngineCore`
directly, one synchronous ``step()`` at a time.

Nothing here waits on a thread, so every draw depends only on earlier draws:
the same seed replays the same example, and a failure shrinks. Rules admit
requests (alone, in bursts that mix failing prompts with good ones, and under
ids already taken), step the core, abort between steps and during a wave, call
worker RPCs with short timeouts, kill a worker, put the core to sleep and wake
it (:mod:`.sleep_rules`), and close. After every rule:
the auditor (INV-001..012) found nothing and no component holds state for a
finished request, and every delivered output still holds the images it was
delivered with. At the end: every request that no fault touched completed (a
failing request excuses its batch mates only where the pipeline fails a whole
batch for it), every completed output equals the pipeline's own output for
that request (called directly, outside the engine), outputs depend on the
seed, and nothing is left held. A rule fills the running set and then admits
urgent work, so any scheduler that can preempt does; another preempts requests
of distinct prompts and seeds one turn at a time, so they resume out of the
order they were preempted in (each must still equal its own oracle). In half
the examples (drawn first) each wave's device copies stay in flight
(:mod:`.copies_in_flight`: their tensors unreadable until the core waits on
them or a rule lands them), and no output may be delivered while its copy is
in flight.
:class:`~diffusion_runtime.testing.reach.Reach` counts the paths reached
(:mod:`.deadline_harness` runs on a virtual clock, with deadlines).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import hypothesis.strategies as st
import torch
from hypothesis.control import current_build_context
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    invariant,
    multiple,
    precondition,
    rule,
)

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineCore, StepResult
from diffusion_runtime.errors import DuplicateRequestError, EngineDeadError, RPCError
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent, RequestStatus
from diffusion_runtime.fsm.events import DeliveryEvent, RunnerEvent, TraceEvent, WaveEvent
from diffusion_runtime.fsm.trace import JsonlTraceWriter
from diffusion_runtime.outputs import STAGES, RequestOutput, Trajectory, images_digest
from diffusion_runtime.sampling_params import MAX_PRIORITY, SamplingParams
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.testing.copies_in_flight import CopiesInFlight
from diffusion_runtime.testing.harness_root import configured
from diffusion_runtime.testing.oracle import FailureScope
from diffusion_runtime.testing.probes import PROBE_PATH
from diffusion_runtime.testing.sleep_rules import SleepRules
from diffusion_runtime.trajectory import SampledOutput


@attrs.define
class RequestRecord:
    """One admission as the harness saw it: inputs, fate and final output."""

    prompt: Any
    params: SamplingParams
    seed: int
    failing: bool
    fatal: bool = False
    aborted: bool = False
    preempted: bool = False
    #: The core refused it at admission (a final error output, no lifecycle).
    refused: bool = False
    final: RequestOutput | None = None
    #: The trajectory parts its progress outputs carried (``stream_trajectory``).
    streamed: list[Trajectory] = attrs.field(factory=list)
    #: The digest of the final output's images when it was delivered.
    delivered_digest: str | None = None
    waves: set[int] = attrs.field(factory=set)


class CoreLifecycleMachine(SleepRules):
    """The harness over an :class:`EngineCore`; configure it with
    :func:`core_lifecycle_machine` or subclass it."""

    #: Prompts whose request kills the executor (a sticky device fault).
    fatal_prompts: ClassVar[st.SearchStrategy[Any] | None] = None
    #: ``pipeline_kwargs`` added to the config, drawn per example before the engine starts.
    pipeline_options: ClassVar[st.SearchStrategy[dict[str, Any]] | None] = None
    rpc_timeouts: ClassVar[st.SearchStrategy[float | None]] = st.sampled_from([None, 1e-4, 5.0])
    # A tuple, so the function is not bound as a method of the machine.
    worker_killer: ClassVar[tuple[Callable[[EngineCore], None], ...]] = ()
    #: Steps a quiet-down may take before the harness calls the engine stuck.
    max_steps_to_idle: ClassVar[int] = 500
    #: Where each example writes its events (the last example run, the shrunk
    #: failing one when there is a failure, is what the file holds).
    trace_path: ClassVar[Path | None] = None
    #: Whether a completed request's model evaluations and cached steps add up to
    #: exactly its steps (see :func:`core_lifecycle_machine`).
    one_evaluation_per_step: ClassVar[bool] = True

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        config = type(self).config_factory()
        options: dict[str, Any] = {}
        if self.pipeline_options is not None:  # the example's first draw (a blob replays it)
            options = current_build_context().data.draw(self.pipeline_options)
            config = attrs.evolve(config, pipeline_kwargs={**config.pipeline_kwargs, **options})
        #: The drawn options, ending the names of paths that depend on them.
        self.variant = "".join(f", {key}={value}" for key, value in sorted(options.items()))
        if options:
            self.reach.note(f"example: {self.variant[2:]}")
        config = attrs.evolve(config, worker_extensions=(*config.worker_extensions, PROBE_PATH))
        self.config = config
        executor = self.executor_cls(config) if self.executor_cls is not None else None
        self.core = EngineCore(
            config, scheduler_cls=self.scheduler_cls, executor=executor, clock=self.core_clock()
        )
        #: The executor's results; in half the examples (drawn), each wave's copies
        #: stay in flight until the core waits on them or a rule lands them.
        held = current_build_context().data.draw(st.booleans())
        self.copies = CopiesInFlight(self.core.executor.execute, hold=held)
        if held:
            self.reach.note("example: copies held in flight")
        self.core.executor.execute = self.copies  # type: ignore[method-assign,assignment]
        self.records: dict[str, RequestRecord] = {}
        self.past: list[RequestRecord] = []
        self.states: dict[str, RequestStatus] = {}
        self.closed = False
        self.dead = False
        self.last_wave_ids: tuple[str, ...] = ()
        self.latest_wave_id = -1
        #: Ids queued with the core and not admitted yet (the next step admits them).
        self.queued: set[str] = set()
        #: Ids aborted while active: the next step must end them FINISHED_ABORTED.
        self.abort_due: set[str] = set()
        #: Image digests of final outputs delivered in the current step, by id.
        self._delivery_digests: dict[str, str] = {}
        #: Runs once when the next wave is scheduled, before the workers run it.
        self._during_wave: Callable[[], None] | None = None
        self._rpc_calls = 0
        self._next_id = 0
        #: Direct outputs computed before shutdown for requests it delivers completed.
        self._expected_at_shutdown: dict[str, torch.Tensor | SampledOutput | None] = {}
        #: Ids now preempted, with the order they were preempted in.
        self._preempted_order: dict[str, int] = {}
        #: States brought back from host memory so far (``preempted_offload_bytes``).
        self._restores = 0
        self.core.machine.subscribe(self._record)
        self._trace_writer: JsonlTraceWriter | None = None
        if self.trace_path is not None:
            self._trace_writer = JsonlTraceWriter(self.trace_path)
            self.core.machine.subscribe(self._trace_writer)

    def core_clock(self) -> Callable[[], float]:
        """The core's clock: the real one here; a subclass may return a virtual one."""
        return time.monotonic

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: self._alive)
    @rule(target=requests, data=st.data())
    def add(self, data: st.DataObject) -> str:
        return self._add(data, data.draw(self.prompts), data.draw(self.params), failing=False)

    @precondition(lambda self: self._alive)
    @rule(target=requests, data=st.data())
    def add_burst(self, data: st.DataObject) -> MultipleResults[str]:
        """Requests admitted together, so they share waves; failing prompts mix in.
        Half the bursts share one set of parameters, so they share a wave even
        where waves need equal step counts (request mode)."""
        tagged = self.prompts.map(lambda p: (p, False))
        if self.failing_prompts is not None:
            tagged = tagged | self.failing_prompts.map(lambda p: (p, True))
        params = st.just(data.draw(self.params)) if data.draw(st.booleans()) else self.params
        mix = data.draw(st.lists(st.tuples(tagged, params), min_size=2, max_size=4))
        self.reach.note("rule: burst")
        return multiple(
            *(self._add(data, prompt, params, failing) for (prompt, failing), params in mix)
        )

    @precondition(lambda self: self._alive and self.failing_prompts is not None)
    @rule(target=requests, data=st.data())
    def add_failing(self, data: st.DataObject) -> str:
        assert self.failing_prompts is not None
        return self._add(data, data.draw(self.failing_prompts), data.draw(self.params), True)

    @precondition(lambda self: self._alive)
    @rule(rid=requests)
    def add_with_a_taken_id(self, rid: str) -> None:
        """An id in use is refused by the scheduler; a finished one starts a new lifecycle."""
        old = self.records[rid]
        active = self._is_active(rid)
        if not active and old.final is None:
            # Ended by an abort whose output comes with the next step: the id is
            # the old request's until that output is out (as a front keeps it).
            self._step()
            if self.dead:
                return
            assert old.final is not None, f"{rid!r} ended, but a step did not deliver its output"
        try:
            self._queue(rid, old.prompt, old.params, old.seed)
        except DuplicateRequestError:
            assert active, f"{rid!r} refused although its request had finished"
            self.reach.note("path: scheduler refused a duplicate id")
            return
        assert not active, f"{rid!r} admitted again while its request was active"
        self.reach.note("path: finished id admitted again")
        self.past.append(old)
        self.records[rid] = RequestRecord(old.prompt, old.params, old.seed, old.failing)

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, 3), label="steps")):
            if not self.dead:
                self._step()

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def land_copies_before_the_core_waits(self, data: st.DataObject) -> None:
        """A step whose copies stay in flight; then the oldest of the copies in
        flight land before the next step waits on them."""
        held, self.copies.hold = self.copies.hold, True
        try:
            self._step()
        finally:
            self.copies.hold = held
        in_flight = len(self.copies.in_flight)
        if in_flight and not self.dead:
            self.copies.complete(data.draw(st.integers(1, in_flight), label="copies landing"))
            self.reach.note("path: a copy landed before the core waited on it")

    @precondition(lambda self: self._alive)
    @rule(rid=requests)
    def abort(self, rid: str) -> None:
        """Queued; the next step applies it before it schedules (checked there)."""
        state = self.states.get(rid)
        name = "queued" if rid in self.queued else state.name if state else "unknown"
        self.reach.note(f"rule: abort a {name} request")
        self._abort(rid)

    @precondition(
        lambda self: self._alive and any(s is RequestStatus.RUNNING for s in self.states.values())
    )
    @rule(data=st.data())
    def abort_a_running_request(self, data: st.DataObject) -> None:
        running = sorted(r for r, s in self.states.items() if s is RequestStatus.RUNNING)
        self.abort(data.draw(st.sampled_from(running), label="running id"))

    @precondition(lambda self: self._alive)
    @rule(rid=requests)
    def abort_during_a_wave(self, rid: str) -> None:
        """An abort queued while the workers run a wave wins over its results (the
        step that ran the wave must end the request FINISHED_ABORTED)."""

        def during_the_wave() -> None:
            if self.states.get(rid) is RequestStatus.RUNNING:
                self.reach.note("path: abort of a running request during its wave")
            self._abort(rid)

        self._step(during_wave=during_the_wave)

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def fill_then_add_urgent_work(self, data: st.DataObject) -> None:
        """Requests fill the running set, a step runs them, then up to a full wave
        of requests that outrank every active one (a better priority; the step
        count of the longest active request, or the one the strategy drew)
        arrives, and a step lets a scheduler that can preempt do so: all of the
        running set, or part of it. Requests preempted for the longest stay
        preempted for a while."""
        active = sum(1 for rid in self.records if self._is_active(rid))
        params = data.draw(self.params)
        for _ in range(max(0, self.config.max_num_seqs - active)):
            self._add(data, data.draw(self.prompts), params, failing=False)
        longest = data.draw(st.booleans(), label="as long as the longest")
        urgent = data.draw(st.integers(1, self.config.max_num_seqs), label="urgent requests")
        self.reach.note("rule: fill, then urgent work")

        def outranking(drawn: SamplingParams, active: list[SamplingParams]) -> SamplingParams:
            steps = max(p.num_inference_steps for p in active) if longest else None
            return attrs.evolve(
                drawn,
                priority=max(min(p.priority for p in active) - 1, -MAX_PRIORITY),
                num_inference_steps=steps or drawn.num_inference_steps,
            )

        self._add_a_wave_between_steps(data, outranking, urgent)

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def preempt_in_turns(self, data: st.DataObject) -> None:
        """Requests of distinct prompts, seeds, step counts and priorities fill the
        running set; then, turn by turn, one request that outranks every active one
        arrives and a step runs, so a scheduler that preempts the worst-ranked
        request preempts a different one at each turn, at a different step. They
        resume best first: out of the order they were preempted in."""
        params = data.draw(self.params)
        active = sum(1 for rid in self.records if self._is_active(rid))
        for rank in range(max(0, self.config.max_num_seqs - active)):
            steps = data.draw(self.params).num_inference_steps  # within the strategy's range
            filler = attrs.evolve(params, priority=rank, num_inference_steps=steps, seed=None)
            self._add(data, data.draw(self.prompts), filler, failing=False)
        self.reach.note("rule: preempt in turns")
        self._step()
        for _ in range(data.draw(st.integers(1, self.config.max_num_seqs), label="turns")):
            active_params = [self.records[r].params for r in self.records if self._is_active(r)]
            if self.dead or not active_params:
                return
            best = min(p.priority for p in active_params)
            urgent = attrs.evolve(params, priority=max(best - 1, -MAX_PRIORITY), seed=None)
            self._add(data, data.draw(self.prompts), urgent, failing=False)
            self._step()

    def _add_a_wave_between_steps(
        self,
        data: st.DataObject,
        params_for: Callable[[SamplingParams, list[SamplingParams]], SamplingParams],
        count: int | None = None,
    ) -> None:
        """A step, then ``count`` (default ``max_num_seqs``) requests with
        ``params_for(drawn params, the active requests' params)``, then a step
        (nothing is added once all have ended)."""
        self._step()
        active = [self.records[rid].params for rid in self.records if self._is_active(rid)]
        if self.dead or not active:
            return
        params = params_for(data.draw(self.params), active)
        for _ in range(self.config.max_num_seqs if count is None else count):
            self._add(data, data.draw(self.prompts), params, failing=False)
        self._step()

    @precondition(lambda self: self._alive and self._ids_in(RequestStatus.PREEMPTED))
    @rule(data=st.data())
    def abort_a_preempted_request(self, data: st.DataObject) -> None:
        preempted = self._ids_in(RequestStatus.PREEMPTED)
        self.abort(data.draw(st.sampled_from(preempted), label="preempted id"))

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def rpc(self, data: st.DataObject) -> None:
        """A worker RPC, perhaps with a timeout too short to meet; no answer is stale."""
        timeout = data.draw(self.rpc_timeouts, label="timeout")
        try:
            self._rpc_calls += 1  # a call that times out still runs on the worker
            answer = self.core.collective_rpc("rpc_sequence", timeout=timeout, unique_reply_rank=0)
        except RPCError as exc:
            if "refuses a finite timeout" in str(exc):
                self._rpc_calls -= 1
                self.reach.note("path: RPC timeout refused")
                return
            # Its late reply is still on the way: the next call must not take it.
            self.reach.note("path: RPC timed out")
            self._rpc_calls += 1
            answer = self.core.collective_rpc("rpc_sequence", unique_reply_rank=0)
        self.reach.note("path: RPC answered")
        assert answer == self._rpc_calls, f"RPC call {self._rpc_calls} got answer {answer!r}"
        held = self.core.collective_rpc("cached_request_ids", unique_reply_rank=0)
        running = {rid for rid, s in self.states.items() if s is RequestStatus.RUNNING}
        if self.config.resolved_mode == "step":
            assert running <= set(held), f"RPC answered {sorted(held)}; running {sorted(running)}"

    @precondition(lambda self: bool(self.worker_killer) and self._alive and self._waves_due())
    @rule()
    def kill_worker(self) -> None:
        """Kill a worker while awake with requests that still need a wave: the steps
        that serve them meet the death (an idle or sleeping core has no call to
        notice it with)."""
        for kill in self.worker_killer:
            kill(self.core)
        self.reach.note("rule: kill a worker")
        self._run_until_death()

    @precondition(lambda self: self.fatal_prompts is not None and self._alive)
    @rule(data=st.data())
    def add_fatal(self, data: st.DataObject) -> None:
        """A request whose device fault will kill the executor when its wave runs."""
        assert self.fatal_prompts is not None
        rid = self._add(data, data.draw(self.fatal_prompts), data.draw(self.params), True)
        self.records[rid].fatal = True

    def _run_until_death(self) -> None:
        with contextlib.suppress(EngineDeadError):
            # No check between steps: its calls would reach the dead worker first.
            self._run_until_idle(check=False)
        assert self.dead, "the engine did not notice its executor died"

    def _check_death(self, active_before: int, preempted_before: bool) -> None:
        """Death fails every request it finds open: none is left waiting or running."""
        if active_before > 1:
            self.reach.note("path: death with other requests active")
        if preempted_before:
            self.reach.note("path: death with a preempted request")
        still_open = sorted(rid for rid in self.records if self._is_active(rid))
        assert not still_open, f"death left requests open: {still_open}"

    @precondition(lambda self: self._alive and len(self.records) >= 2)
    @rule()
    def close(self) -> None:
        active = {rid for rid in self.records if self._is_active(rid)}
        if active:
            self.reach.note("path: close with active requests")
        if any(self.states.get(rid) is RequestStatus.PREEMPTED for rid in active):
            self.reach.note("path: close with a preempted request")
        if self.queued:
            self.reach.note("path: close with queued requests")
        self._expect_before_shutdown()
        self._take(self.core.shutdown())
        self.closed = True
        for rid in active:
            final = self.records[rid].final
            assert final is not None, f"close ended {rid!r} without a final output"
            if self.records[rid].refused:
                continue
            assert final.status is RequestStatus.FINISHED_ABORTED, (rid, final)
            self.records[rid].aborted = True

    @precondition(lambda self: not self._alive)
    @rule()
    def step_after_the_end(self) -> None:
        """A closed or dead core refuses to run anything."""
        try:
            self.core.step()
        except EngineDeadError:
            return
        raise AssertionError("a closed or dead core ran a step")

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def nothing_is_held_for_finished_requests(self) -> None:
        if not self._alive:
            return
        snapshot = self.core.snapshot()
        finished = {rid for rid, s in self.states.items() if s in TERMINAL_STATES}
        preempted = {rid for rid, s in self.states.items() if s is RequestStatus.PREEMPTED}
        step_mode = self.config.resolved_mode == "step"
        self.check_nothing_held(snapshot, finished, preempted, step_mode)
        if step_mode:
            # Only a state that sat out the last step may be in host memory.
            idle = snapshot.runner_cached_ids - snapshot.running_ids
            assert snapshot.runner_offloaded_ids <= idle, snapshot
            if snapshot.runner_offloaded_ids:
                self.reach.note("path: a preempted state in host memory")
            if self.config.preempted_offload_bytes:
                restores: int = self.core.collective_rpc("offload_restores", unique_reply_rank=0)
                for _ in range(restores - self._restores):
                    self.reach.note("path: resumed from host memory")
                self._restores = restores
        pipeline_held = set(self._pipeline_held()) & finished
        assert not pipeline_held, f"the pipeline holds finished requests {sorted(pipeline_held)}"

    @invariant()
    def delivered_images_stay_as_delivered(self) -> None:
        """An output's images do not change once delivered (a reused buffer would)."""
        for record in self._all_records():
            final, digest = record.final, record.delivered_digest
            if final is None or final.image_batch is None or digest is None:
                continue
            if images_digest(final.image_batch) != digest:
                raise AssertionError(
                    f"{final.request_id!r} (prompt {record.prompt!r}): its delivered images "
                    "changed afterwards (do they share memory with a reused buffer?)"
                )
            if record.waves and max(record.waves) < self.latest_wave_id:
                self.reach.note("path: delivered images re-checked after later waves")

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            # A rule or invariant failed (hypothesis tears down in a ``finally``):
            # release everything, and let its failure be the one reported.
            self._release_all()
            return
        try:
            if self._alive:
                self.wake_for_the_end()
                self._run_until_idle()
            if self._alive:
                held = self._pipeline_held()
                assert not held, f"the pipeline holds state after every request ended: {held}"
            self._check_outcomes()
        finally:
            self._take(self._release_all())
        self.delivered_images_stay_as_delivered()
        self.check_trace_ended(may_have_died=self.dead)

    def _release_all(self) -> list[RequestOutput]:
        """Shut the core down and close the trace; the outputs the shutdown made."""
        if self._alive:
            self._expect_before_shutdown()
        try:
            return self.core.shutdown()
        finally:
            if self._trace_writer is not None:
                self._trace_writer.close()

    # -- checks ------------------------------------------------------------------------

    def _check_outcomes(self) -> None:
        """Every request no fault, abort or death touched completed, with its image count."""
        if self.dead:
            return
        poisoned = self._waves_failed_whole()
        for record in self._all_records():
            final = record.final
            assert final is not None, f"no final output for a request with prompt {record.prompt!r}"
            if final.status is RequestStatus.FINISHED_COMPLETED:
                self.check_image_count(final, record.params)
            excused = bool(record.waves & poisoned)
            if excused and not record.failing:
                self.reach.note("path: a request excused by a batch mate's forward failure")
            touched = record.failing or record.aborted or excused
            if not touched:
                assert final.status is RequestStatus.FINISHED_COMPLETED, (
                    f"{final.request_id!r} (prompt {record.prompt!r}) was valid and untouched "
                    f"by faults or aborts, yet ended {final.status}: {final.error}"
                )

    def _expect_before_shutdown(self) -> None:
        """The direct outputs of requests that completed but whose outputs still wait
        on a copy: shutdown delivers them after the engine closed its pipeline,
        which the oracle may share."""
        for rid, record in self.records.items():
            if self.states.get(rid) is RequestStatus.FINISHED_COMPLETED and record.final is None:
                self._expected_at_shutdown[rid] = self.expected_output(
                    record.prompt, record.params, record.seed
                )

    def _check_fields(self, record: RequestRecord, final: RequestOutput) -> None:
        """A final output reports the request's seed, and metrics that add up: the
        queue and execution times are parts of the total, there is one duration
        per stage, a request that never ran spent no time executing or working,
        and one that completed spent some denoising; its model evaluations and
        cached steps add up to the steps it ran (all of them once completed)."""
        assert final.seed == record.seed, (
            f"{final.request_id!r} reports seed {final.seed}; it ran with {record.seed}"
        )
        metrics = final.metrics
        assert metrics is not None, f"{final.request_id!r}: a final output without metrics"
        queue, execution, total = (
            metrics.queue_time_s,
            metrics.execution_time_s,
            metrics.total_time_s,
        )
        assert min(queue, execution) >= 0.0, (final.request_id, metrics)
        # Differences of one clock's readings: equal up to rounding on a real clock,
        # exactly on a virtual one.
        assert math.isclose(queue + execution, total, rel_tol=1e-9, abs_tol=1e-9), (
            f"{final.request_id!r}: queue {queue} s + execution {execution} s is not "
            f"the total {total} s"
        )
        stages = metrics.stage_durations
        assert tuple(stages) == STAGES and stages["queue"] == queue, (
            f"{final.request_id!r}: stage durations {dict(stages)} are not one per stage "
            f"of {STAGES}, starting with the queue time {queue} s"
        )
        assert min(stages.values()) >= 0.0, (final.request_id, dict(stages))
        worked = sum(stages[stage] for stage in STAGES[1:])
        if not record.waves:
            assert execution == 0.0 and worked == 0.0, (
                f"{final.request_id!r} never ran, yet reports {execution} s executing "
                f"and {worked} s of work"
            )
            self.reach.note("path: metrics of a request that never ran")
        elif final.status is RequestStatus.FINISHED_COMPLETED:
            assert stages["denoise"] > 0.0, (
                f"{final.request_id!r} completed after {len(record.waves)} wave(s), "
                f"yet reports no denoising time"
            )
            steps = metrics.model_evaluations + metrics.cached_steps
            wanted = record.params.num_inference_steps
            assert steps == wanted or (not self.one_evaluation_per_step and steps > wanted), (
                f"{final.request_id!r} completed its {record.params.num_inference_steps} "
                f"steps, yet reports {metrics.model_evaluations} model evaluations and "
                f"{metrics.cached_steps} cached steps"
            )

    # -- helpers -----------------------------------------------------------------------

    @property
    def _alive(self) -> bool:
        return not self.closed and not self.dead

    def _add(self, data: st.DataObject, prompt: Any, params: SamplingParams, failing: bool) -> str:
        seed = params.seed if params.seed is not None else data.draw(st.integers(0, 2**31))
        rid = f"r{self._next_id}"
        self._next_id += 1
        self.core.validate(prompt, params)
        self._queue(rid, prompt, params, seed)
        self.records[rid] = RequestRecord(prompt, params, seed, failing)
        return rid

    def _queue(self, rid: str, prompt: Any, params: SamplingParams, seed: int) -> None:
        """Queue a request with the core (it arrives now; the next step admits it)."""
        self.core.add_request(rid, prompt, params, seed)
        self.queued.add(rid)

    def _abort(self, rid: str) -> None:
        if self._is_active(rid):
            self.records[rid].aborted = True
            self.abort_due.add(rid)
        if self.states.get(rid) is RequestStatus.PREEMPTED:
            self.reach.note("path: abort of a preempted request")
        self.core.abort([rid])

    def _step(self, during_wave: Callable[[], None] | None = None) -> StepResult | None:
        """One core step (``during_wave`` runs once its wave is scheduled); None if it died."""
        active_before = sum(1 for rid in self.records if self._is_active(rid))
        preempted_before = any(s is RequestStatus.PREEMPTED for s in self.states.values())
        self._during_wave = during_wave
        waited = self.copies.waited
        try:
            result = self.core.step()
        except EngineDeadError:
            self.dead = True
            # A dead core drops its inbox: queued requests never had a lifecycle, and
            # a front fails their callers with the error.
            self.queued.clear()
            self._check_death(active_before, preempted_before)
            if not (self._fatal_wave() or self.worker_killer):
                raise
            return None
        finally:
            self._during_wave = None
        if self.copies.waited > waited:
            self.reach.note("path: the core waited on a copy in flight")
        self._take(result.outputs)
        assert not (result.executed and self._fatal_wave()), (
            "a device fault did not kill the executor (it must mark itself failed)"
        )
        self._check_aborts_applied()
        return result

    def _check_aborts_applied(self) -> None:
        """Aborts queued before a step, or during its wave, ended their requests in it."""
        due, self.abort_due = self.abort_due, set()
        for rid in sorted(due):
            assert rid not in self.queued, f"{rid!r} is still queued after a step"
            assert self.states.get(rid) is RequestStatus.FINISHED_ABORTED, (
                f"{rid!r} was aborted while active, but after the next step it is "
                f"{self.states.get(rid)}"
            )

    def _run_until_idle(self, check: bool = True) -> None:
        """Step until nothing is left; with ``check``, check after each step what the
        engine holds (as after every rule), so a teardown's steps are checked too."""
        for _ in range(self.max_steps_to_idle):
            if self.dead or not self.core.has_unfinished():
                return
            self._step()
            if check:
                self.nothing_is_held_for_finished_requests()
        raise AssertionError(f"the engine still had work after {self.max_steps_to_idle} steps")

    def _take(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            record = self.records.get(output.request_id)
            assert record is not None, f"an output for an id never admitted: {output}"
            trajectory = output.trajectory
            carried = (
                output.image_batch,
                output.latents,
                None if trajectory is None else trajectory.latents,
                None if trajectory is None else trajectory.log_probs,
            )
            assert not any(self.copies.carries(tensor) for tensor in carried), (
                f"{output.request_id!r}: an output delivered while its copy was in flight "
                "(its tensors were not in host memory yet)"
            )
            if not output.finished:
                assert output.status is RequestStatus.RUNNING, output
                assert record.final is None, f"a progress output after the final one: {output}"
                self.reach.note("path: progress output")
                self._take_part(record, output)
                continue
            assert record.final is None, f"a second final output: {output}"
            if record.refused:
                assert output.status is RequestStatus.FINISHED_ERROR, output
                record.final = output
                continue
            assert self.states.get(output.request_id) is output.status, (
                f"{output.request_id!r} delivered as {output.status}, "
                f"but its lifecycle ended {self.states.get(output.request_id)}"
            )
            record.final = output
            record.delivered_digest = self._delivery_digests.pop(output.request_id, None)
            self._check_fields(record, output)
            self.reach.note(f"outcome: {output.status.name}")
            if output.status is RequestStatus.FINISHED_COMPLETED:
                args = (output, record.prompt, record.params, record.seed)
                if output.request_id in self._expected_at_shutdown:
                    expected = self._expected_at_shutdown.pop(output.request_id)
                    self.check_against_expected(*args, expected)
                else:
                    self.check_against_the_pipeline(*args)
                self._check_streamed(record, output)
                if output.metrics is not None and output.metrics.cached_steps:
                    self.reach.note("path: a request reused cached model outputs as the oracle")
                    if record.preempted:
                        self.reach.note("path: a preempted request reused cached outputs")
                if record.preempted:
                    self.reach.note("path: a preempted request completed as the oracle")
                    if output.trajectory is not None:
                        self.reach.note("output: a preempted request's trajectory")
                    if record.params.timesteps is not None:
                        self.reach.note("output: a preempted request on custom timesteps")

    def _take_part(self, record: RequestRecord, output: RequestOutput) -> None:
        """A progress output carries a trajectory part only if its request streams its
        trajectory, and each part starts where the one before it ended."""
        part = output.trajectory
        if part is None:
            return
        rid = output.request_id
        assert record.params.stream_trajectory, f"{rid!r} streams no trajectory, yet got {part}"
        start = record.streamed[-1].end_step if record.streamed else 0
        assert part.first_step == start and part.end_step > start, (
            f"{rid!r}: a part of steps [{part.first_step}, {part.end_step}) after the parts "
            f"up to step {start}"
        )
        record.streamed.append(part)

    def _check_streamed(self, record: RequestRecord, output: RequestOutput) -> None:
        """The parts a completed request streamed, with what its final output adds after
        them, are its final trajectory, bit for bit."""
        whole = output.trajectory
        if not record.streamed or whole is None:
            return
        joined = Trajectory.join([*record.streamed, whole.steps_from(record.streamed[-1].end_step)])
        what = f"{output.request_id!r}: the streamed parts'"
        self.check_same_trajectory(joined, whole, 0.0, what, "its final trajectory's")
        self.reach.note("output: a streamed trajectory joined to the final one")

    def _record(self, event: TraceEvent) -> None:
        super()._record(event)
        if isinstance(event, LifecycleEvent) and not event.rejected:
            rid = event.request_id
            self.states[rid] = event.dest
            self._note_preemption(event)
            if event.source is None:
                self.queued.discard(rid)
            elif (
                event.dest in TERMINAL_STATES
                and event.wave_id is None
                and self.copies.carries_progress_of(rid)
            ):
                self.reach.note("path: a request ended with its progress in flight")
        elif isinstance(event, DeliveryEvent) and event.finished and event.digest:
            self._delivery_digests[event.request_id] = event.digest
        elif isinstance(event, RunnerEvent) and len(event.produced) > 1:
            self.reach.note(f"path: a wave producing several requests' images{self.variant}")
        elif isinstance(event, WaveEvent):
            during_wave, self._during_wave = self._during_wave, None
            # Asleep, a step's only wave releases finished ids as it ends: none runs.
            if during_wave is not None and self.asleep_at is None:
                during_wave()
            self.last_wave_ids = event.scheduled_ids
            self.latest_wave_id = event.wave_id
            for rid in event.scheduled_ids:
                record = self.records.get(rid)
                if record is not None:
                    record.waves.add(event.wave_id)
            failing = {rid for rid in event.scheduled_ids if self._is_failing(rid)}
            if failing and len(failing) < len(event.scheduled_ids):
                self.reach.note("path: a wave mixing failing and good requests")
                for prompt in sorted({repr(self.records[rid].prompt) for rid in failing}):
                    self.reach.note(f"path: a wave mixing {prompt} and good requests{self.variant}")
            if len(event.scheduled_ids) > 1:
                self.reach.note("path: a wave of several requests")

    def _note_preemption(self, event: LifecycleEvent) -> None:
        rid = event.request_id
        if event.dest is RequestStatus.PREEMPTED:
            self.reach.note("path: preempted")
            self._preempted_order[rid] = len(self._preempted_order)
            record = self.records.get(rid)
            if record is not None:
                record.preempted = True
        elif event.source is RequestStatus.PREEMPTED:
            order = self._preempted_order.pop(rid)
            if event.dest is RequestStatus.RUNNING:
                self.reach.note("path: resumed")
                if any(other < order for other in self._preempted_order.values()):
                    self.reach.note("path: resumed before a request preempted earlier")

    def _fatal_wave(self) -> bool:
        """Whether the last wave held a request meant to kill the executor."""
        return any(rid in self.records and self.records[rid].fatal for rid in self.last_wave_ids)

    def _is_failing(self, rid: str) -> bool:
        record = self.records.get(rid)
        return record is not None and record.failing

    def _waves_due(self) -> bool:
        """Whether the core is awake and an open request is not aborted (so a wave
        will run for it)."""
        return self.asleep_at is None and any(
            self._is_active(rid) and not self.records[rid].aborted for rid in self.records
        )

    def _is_active(self, rid: str) -> bool:
        state = self.states.get(rid)
        return rid in self.queued or (state is not None and state not in TERMINAL_STATES)

    def _waves_failed_whole(self) -> set[int]:
        """The waves of failing requests that the pipeline fails together with their
        batch mates (a raising forward or denoising step); a request whose result is
        merely missing, or whose own step fails, fails alone."""
        waves: set[int] = set()
        for record in self._all_records():
            if record.failing and record.waves:
                scope = self.oracle.failure_scope(record.prompt, record.params, record.seed)
                if scope is FailureScope.BATCH:
                    waves |= record.waves
        return waves

    def _ids_in(self, state: RequestStatus) -> list[str]:
        return sorted(rid for rid, s in self.states.items() if s is state and rid in self.records)

    def _all_records(self) -> list[RequestRecord]:
        return [*self.past, *self.records.values()]

    def _pipeline_held(self) -> list[str]:
        held: list[str] = self.core.collective_rpc("pipeline_held_request_ids", unique_reply_rank=0)
        return held


def core_lifecycle_machine(
    config: Callable[[], EngineConfig],
    *,
    prompts: st.SearchStrategy[Any] | None = None,
    params: st.SearchStrategy[SamplingParams] | None = None,
    failing_prompts: st.SearchStrategy[Any] | None = None,
    fatal_prompts: st.SearchStrategy[Any] | None = None,
    pipeline_options: st.SearchStrategy[dict[str, Any]] | None = None,
    rpc_timeouts: st.SearchStrategy[float | None] | None = None,
    scheduler_cls: type[BaseScheduler] | None = None,
    executor_cls: type[DiffusionExecutor] | None = None,
    worker_killer: Callable[[EngineCore], None] | None = None,
    oracle_tolerance: float = 0.0,
    trace_path: Path | None = None,
    base: type[CoreLifecycleMachine] = CoreLifecycleMachine,
    one_evaluation_per_step: bool = True,
) -> type[CoreLifecycleMachine]:
    """A core harness class for engines built from ``config()``.

    ``prompts`` and ``params`` generate valid requests; ``failing_prompts``
    requests the pipeline is known to fail (they also excuse their wave
    mates); ``fatal_prompts`` requests whose device fault kills the executor;
    ``pipeline_options`` ``pipeline_kwargs`` drawn per example;
    ``scheduler_cls`` and ``executor_cls`` plug in your own
    components; ``worker_killer`` kills a worker of a multi-process engine;
    ``oracle_tolerance`` allows an absolute difference from the direct run;
    ``trace_path`` keeps the events of the last example run.
    ``one_evaluation_per_step=False`` is for schedulers whose schedule has more
    timesteps than steps (Heun, KDPM2, PNDM's warm-up): a completed request's
    model evaluations and cached steps then add up to more than its steps,
    not exactly to them.
    """
    return configured(
        base,
        "ConfiguredCoreLifecycle",
        config,
        prompts=prompts,
        params=params,
        failing_prompts=failing_prompts,
        fatal_prompts=fatal_prompts,
        pipeline_options=pipeline_options,
        rpc_timeouts=rpc_timeouts,
        scheduler_cls=scheduler_cls,
        executor_cls=executor_cls,
        worker_killer=(worker_killer,) if worker_killer else None,
        oracle_tolerance=oracle_tolerance,
        trace_path=trace_path,
        one_evaluation_per_step=one_evaluation_per_step,
    )
