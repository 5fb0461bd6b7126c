"""A hypothesis state machine over the real engine: add / abort / drop a consumer / close.

After every step: each admitted id has at most one terminal transition, the
runtime never attempted an illegal one, and nothing is left in the scheduler or
the runner for an id that has finished. At the end: every admitted id reached
exactly one terminal state, and every completed output equals what that
request produces alone with the same seed (batching never changes or swaps a
result).
"""

from __future__ import annotations

import asyncio
from typing import Any

import hypothesis.strategies as st
import torch
from conftest import engine_threads, factory_of
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from diffusion_runtime import DiffusionEngine, EngineConfig, RequestOutput, SamplingParams
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent, RequestStatus
from diffusion_runtime.fsm.audit import Auditor
from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.runner.protocols import PipelineRequest
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline, SeededNoisePipeline

PROMPTS = st.sampled_from(["cat", "dog", 7, "fail", "missing", "bad-step"])


class EngineLifecycle(RuleBasedStateMachine):
    requests = Bundle("requests")
    mode = "request"

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = FaultInjectingPipeline("cpu")
        self.engine = DiffusionEngine.make_engine(
            EngineConfig(
                pipeline=factory_of(self.pipeline),
                max_num_seqs=3,
                device="cpu",
                execution_mode=self.mode,
            )
        )
        self.events: list[LifecycleEvent] = []
        self.auditor = Auditor()
        self.engine.machine.subscribe(self._record)
        self.pipeline.forward_batches.clear()
        self.pipeline.step_batches.clear()
        self.loop = asyncio.new_event_loop()
        self.inputs: dict[str, tuple[Any, SamplingParams]] = {}
        self.unread: set[str] = set()
        self.outputs: dict[str, RequestOutput] = {}
        self.closed = False

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: not self.closed)
    @rule(
        target=requests,
        prompt=PROMPTS,
        steps=st.integers(1, 3),
        seed=st.integers(0, 2**16),
        outputs=st.integers(1, 2),
    )
    def add(self, prompt: Any, steps: int, seed: int, outputs: int) -> str:
        params = SamplingParams(
            num_inference_steps=steps, seed=seed, num_outputs_per_prompt=outputs
        )
        rid = self.loop.run_until_complete(self.engine.add_request(prompt, params))
        self.inputs[rid] = (prompt, params)
        self.unread.add(rid)
        return rid

    @rule(rid=requests)
    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    @precondition(lambda self: self.unread)
    @rule(data=st.data())
    def drop_consumer(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.unread)))
        self.unread.discard(rid)
        self.loop.run_until_complete(self._read_then_leave(rid))

    @rule()
    def read_all(self) -> None:
        for rid in sorted(self.unread):
            self.loop.run_until_complete(self._read(rid))
        self.unread.clear()

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        self.engine.close()
        self.closed = True

    def _record(self, event: TraceEvent) -> None:
        self.auditor.feed(event)
        if isinstance(event, LifecycleEvent):
            self.events.append(event)

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def the_auditor_finds_nothing(self) -> None:
        assert self.auditor.violations == [], self.auditor.violations[0].describe()

    @invariant()
    def the_runtime_never_attempts_an_illegal_transition(self) -> None:
        assert [e for e in self.events if e.rejected] == []

    @invariant()
    def at_most_one_terminal_transition_per_id(self) -> None:
        terminal = [e.request_id for e in self.events if e.dest in TERMINAL_STATES]
        assert len(terminal) == len(set(terminal))

    @invariant()
    def nothing_is_left_for_a_finished_id(self) -> None:
        if self.closed:
            snapshot = self.engine.snapshot()
            assert not snapshot.scheduler_ids and not snapshot.waiting and not snapshot.running_ids
            return
        # Read the events first: the snapshot is taken between two ticks, after
        # the terminal hooks of every transition published so far have run.
        finished = {e.request_id for e in self.events if e.dest in TERMINAL_STATES}
        snapshot = self.engine.snapshot()
        assert not finished & snapshot.scheduler_ids
        assert not finished & snapshot.runner_cached_ids
        if self.mode == "step":  # step state exists exactly for the running requests
            assert snapshot.runner_cached_ids == snapshot.running_ids

    def teardown(self) -> None:
        try:
            if not self.closed:
                self.read_all()
            self.engine.close()
            self._check_final_states()
            assert self.auditor.complete
            violations = self.auditor.finish()
            assert violations == [], violations[0].describe()
        finally:
            self.engine.close()
            self.loop.close()
        assert engine_threads() == []

    # -- helpers -----------------------------------------------------------------------

    def _check_final_states(self) -> None:
        terminal = {e.request_id: e for e in self.events if e.dest in TERMINAL_STATES}
        assert set(terminal) == set(self.inputs), "every admitted id reaches a terminal state"
        for rid, out in self.outputs.items():
            assert out.status is terminal[rid].dest
            if out.ok:
                prompt, params = self.inputs[rid]
                assert torch.equal(torch.stack(out.images), solo(prompt, params, out.seed))
        for rid, event in terminal.items():
            should_complete = self._should_complete(rid)
            if should_complete and event.trigger != "abort":
                assert event.dest is RequestStatus.FINISHED_COMPLETED, (rid, event)
            if event.dest is RequestStatus.FINISHED_COMPLETED:
                assert should_complete, (rid, event)

    def _should_complete(self, rid: str) -> bool:
        """Whether ``rid`` ran and no injected fault touched it (its own or a batch mate's)."""
        prompt_of = {r: str(inputs[0]) for r, inputs in self.inputs.items()}
        if self.mode == "request":
            batches = [b for b in self.pipeline.forward_batches if rid in b]
            poisons, own_poisons = ("fail", "bad-step"), ("missing",)
        else:
            batches = [b for b in self.pipeline.step_batches if rid in b]
            poisons, own_poisons = ("fail",), ("bad-step",)
        mates = {mate for batch in batches for mate in batch}
        return (
            bool(batches)
            and not any(word in prompt_of[mate] for mate in mates for word in poisons)
            and not any(word in prompt_of[rid] for word in own_poisons)
        )

    async def _read(self, rid: str) -> None:
        try:
            async for out in self.engine.stream(rid):
                self.outputs[rid] = out
        except Exception as exc:  # the engine was closed under the stream
            assert self.closed, exc

    async def _read_then_leave(self, rid: str) -> None:
        reader = self.engine.stream(rid)
        step = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)
        if step.done():
            if step.exception() is None:
                self.outputs[rid] = step.result()
        else:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await reader.aclose()


def solo(prompt: Any, params: SamplingParams, seed: int) -> torch.Tensor:
    request = PipelineRequest("solo", prompt, params, seed, torch.device("cpu"))
    return SeededNoisePipeline("cpu").forward([request])["solo"]


class StepModeEngineLifecycle(EngineLifecycle):
    mode = "step"


TestRequestMode = EngineLifecycle.TestCase
TestStepMode = StepModeEngineLifecycle.TestCase
