"""Exact pause semantics, repeated, and generate() timeouts, in process (uni and mp).

Ray's rounds are in test_ray_executor.py (they need its cluster) and the
stage's in test_stage.py.
"""

from __future__ import annotations

import math
import time

import pytest
from pause_rounds import ROUNDS, run_rounds

from diffusion_runtime import DiffusionEngine, EngineConfig, SamplingParams
from diffusion_runtime.errors import InvalidFieldError

#: Request mode: one params object, so the three requests may share a wave.
ONE_STEP = SamplingParams(num_inference_steps=1, seed=1)
#: Step mode: mixed step counts (they share a step batch).
MIXED_STEPS = (
    SamplingParams(num_inference_steps=1, seed=1),
    SamplingParams(num_inference_steps=3, seed=2),
    SamplingParams(num_inference_steps=2, seed=3),
)


def engine_for(
    mode: str, backend: str, pipeline: str = "testing-noise", max_num_seqs: int = 4
) -> DiffusionEngine:
    return DiffusionEngine.make_engine(
        EngineConfig(
            pipeline=pipeline,
            device="cpu",
            execution_mode=mode,
            executor_backend=backend,
            max_num_seqs=max_num_seqs,
            warmup=False,
        )
    )


@pytest.mark.parametrize("backend", ["uni", "mp"])
@pytest.mark.parametrize("mode", ["request", "step"])
def test_what_was_queued_while_paused_is_scheduled_together_and_aborts_apply_first(
    mode: str, backend: str
) -> None:
    params = (ONE_STEP,) * 3 if mode == "request" else MIXED_STEPS
    with engine_for(mode, backend) as engine:
        run_rounds(engine, params, ROUNDS)


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_generate_with_a_timeout_returns_and_the_engine_serves_on(mode: str, backend: str) -> None:
    """1000-step requests with a 50 ms timeout. In step mode the call returns after
    the step (0.7 ms on digits) that passes the deadline. In request mode a wave
    runs whole, so the call returns after the wave that passes it (one request a
    wave, each one forward of the noise pipeline) and the rest never start."""
    pipeline, prompts = ("digits", ["1"]) if mode == "step" else ("testing-noise", ["1"] * 64)
    with engine_for(mode, backend, pipeline, max_num_seqs=1) as engine:
        long = SamplingParams(num_inference_steps=1000, seed=1)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 0\.05 s"):
            engine.generate(prompts, long, timeout=0.05)
        assert time.monotonic() > started + 0.05  # not before the timeout
        [output] = engine.generate(["2"], ONE_STEP, timeout=60.0)
        assert output.ok
        snapshot = engine.snapshot()
        assert not snapshot.scheduler_ids and not snapshot.runner_cached_ids


@pytest.mark.parametrize("timeout", [math.nan, 0, 0.0, -1, -math.inf, "1", True])
def test_generate_refuses_a_timeout_that_is_not_a_positive_number(timeout: object) -> None:
    with engine_for("request", "uni") as engine:
        with pytest.raises(InvalidFieldError, match=r"generate\.timeout"):
            engine.generate(["1"], ONE_STEP, timeout=timeout)  # type: ignore[arg-type]
        assert engine.queue_length == 0
        [output] = engine.generate(["1"], ONE_STEP)
        assert output.ok
