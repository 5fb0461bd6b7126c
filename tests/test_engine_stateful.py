"""The lifecycle harness over the real engine, in request and step mode.

The harness (``diffusion_runtime.testing.harness``) checks the auditor,
cleanup after every step, one terminal state per admission, and that every
completed output equals its request run alone. This file adds what only a
fault-injecting pipeline allows: a request untouched by any injected fault
must complete unless it was aborted, and one touched by a fault must not.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from conftest import (
    assert_device_memory_at,
    device_memory_in_use,
    engine_threads,
    factory_of,
    suite_device,
)

from diffusion_runtime import DiffusionEngine, EngineConfig, RequestStatus
from diffusion_runtime.testing.harness import EngineLifecycleMachine
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline
from diffusion_runtime.testing.strategies import sampling_params


class FaultInjectingLifecycle(EngineLifecycleMachine):
    mode = "request"
    prompts = st.sampled_from(["cat", "dog", 7])
    failing_prompts = st.sampled_from(["fail", "missing", "bad-step"])
    params = sampling_params(steps=(1, 3), outputs=(1, 2))

    def build_engine(self) -> DiffusionEngine:
        if suite_device() == "cuda":
            self.device_memory = device_memory_in_use()
        self.pipeline = FaultInjectingPipeline(suite_device())
        config = EngineConfig(
            pipeline=factory_of(self.pipeline),
            max_num_seqs=3,
            device=suite_device(),
            execution_mode=self.mode,
        )
        engine = DiffusionEngine.make_engine(config)
        self.pipeline.forward_batches.clear()
        self.pipeline.step_batches.clear()
        return engine

    def teardown(self) -> None:
        super().teardown()
        # Requests this machine added once (solo reruns and reused ids are not judged here:
        # the batches recorded by id cannot tell two lifecycles of one id apart).
        admissions = Counter(e.request_id for e in self.lifecycle if e.source is None)
        terminal = {
            e.request_id: e
            for e in self.lifecycle
            if e.dest.is_finished and e.request_id in self.inputs and admissions[e.request_id] == 1
        }
        for rid, event in terminal.items():
            should_complete = self._should_complete(rid)
            if should_complete and event.trigger != "abort":
                assert event.dest is RequestStatus.FINISHED_COMPLETED, (rid, event)
            if event.dest is RequestStatus.FINISHED_COMPLETED:
                assert should_complete, (rid, event)
        assert engine_threads() == []
        if suite_device() == "cuda":  # after every example, not only after the test
            del self.pipeline
            assert_device_memory_at(self.device_memory)

    def _should_complete(self, rid: str) -> bool:
        """Whether ``rid`` ran and no injected fault touched it (its own or a batch mate's)."""
        prompt_of = {r: str(inputs[0]) for r, inputs in self.inputs.items()}
        for run in self.batches:  # grouped prompts run as child requests
            prompt_of.update(zip(run.child_ids, map(str, run.prompts), strict=True))
        if self.mode == "request":
            batches = [b for b in self.pipeline.forward_batches if rid in b]
            poisons, own_poisons = ("fail", "bad-step"), ("missing",)
        else:
            batches = [b for b in self.pipeline.step_batches if rid in b]
            poisons, own_poisons = ("fail",), ("bad-step",)
        mates = {mate for batch in batches for mate in batch}
        touched = any(word in prompt_of[mate] for mate in mates for word in poisons)
        return bool(batches) and not touched and not any(w in prompt_of[rid] for w in own_poisons)


class StepModeLifecycle(FaultInjectingLifecycle):
    mode = "step"


TestRequestMode = FaultInjectingLifecycle.TestCase
TestStepMode = StepModeLifecycle.TestCase
