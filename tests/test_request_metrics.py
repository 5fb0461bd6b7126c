"""Each final output's metrics: the time per stage of the request's work, and its memory peak."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import pytest
import torch

from diffusion_runtime import DiffusionEngine, EngineConfig, SamplingParams
from diffusion_runtime.outputs import STAGES, RequestMetrics
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.runner import memory_peak
from diffusion_runtime.testing.pipelines import SeededNoisePipeline

PARAMS = SamplingParams(num_inference_steps=4, seed=0)
BIG_MB = 256
HAS_RSS_PEAK = os.path.exists("/proc/self/clear_refs")


class AllocatesForBigPrompts(SeededNoisePipeline):
    """Request mode: a forward over the prompt "big" touches ``BIG_MB`` of fresh memory."""

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        if any(request.prompt == "big" for request in batch):
            scratch = torch.ones(BIG_MB * 2**20 // 4)
            assert float(scratch[-1]) == 1.0
            del scratch
        return super().forward(batch)


def _check_stages(metrics: RequestMetrics | None) -> RequestMetrics:
    assert metrics is not None
    durations = metrics.stage_durations
    assert tuple(durations) == STAGES
    assert all(seconds >= 0.0 for seconds in durations.values())
    assert durations["queue"] == metrics.queue_time_s
    for stage in ("encode", "denoise", "decode"):
        assert durations[stage] > 0.0, stage
    # Stage times are parts of the request's life (two clocks: a small allowance).
    assert sum(durations.values()) <= metrics.total_time_s + 5e-3
    return metrics


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_every_stage_is_timed_and_the_peak_is_read(mode: str, backend: str) -> None:
    config = EngineConfig(
        pipeline="digits", execution_mode=mode, max_num_seqs=2, executor_backend=backend
    )
    with DiffusionEngine.make_engine(config) as engine:
        outputs = engine.generate(["3", "4"], PARAMS)
    for output in outputs:
        metrics = _check_stages(output.metrics)
        if HAS_RSS_PEAK:
            assert metrics.peak_memory_mb is not None and metrics.peak_memory_mb > 10.0


def test_a_batched_call_counts_in_full_for_each_of_its_requests() -> None:
    config = EngineConfig(pipeline="digits", execution_mode="request", max_num_seqs=2)
    with DiffusionEngine.make_engine(config) as engine:
        first, second = engine.generate(["3", "4"], PARAMS)
    assert first.metrics is not None and second.metrics is not None
    for stage in ("encode", "denoise", "decode"):
        assert first.metrics.stage_durations[stage] == second.metrics.stage_durations[stage]


@pytest.mark.skipif(not HAS_RSS_PEAK, reason="the resident-set peak is read from Linux's /proc")
def test_the_peak_is_the_high_water_mark_of_the_requests_own_waves() -> None:
    config = EngineConfig(
        pipeline=AllocatesForBigPrompts, execution_mode="request", max_num_seqs=1, warmup=False
    )
    with DiffusionEngine.make_engine(config) as engine:
        [small] = engine.generate(["small"], PARAMS)
        [big] = engine.generate(["big"], PARAMS)
        [small_again] = engine.generate(["small"], PARAMS)
    peaks = [o.metrics.peak_memory_mb if o.metrics else None for o in (small, big, small_again)]
    assert None not in peaks
    small_mb, big_mb, small_again_mb = peaks
    assert big_mb - small_mb >= 0.8 * BIG_MB  # type: ignore[operator]
    # The mark starts again with each wave: the big wave's peak is not carried over.
    assert big_mb - small_again_mb >= 0.8 * BIG_MB  # type: ignore[operator]


def test_a_system_that_refuses_the_reset_reports_no_peak_and_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernel refuses the high-water mark's reset (here: writes to /dev/full
    fail), the meter reports nothing rather than failing the wave."""
    monkeypatch.setattr(memory_peak, "_CLEAR_REFS", "/dev/full")
    config = EngineConfig(pipeline="testing-noise", device="cpu", warmup=False)
    with DiffusionEngine.make_engine(config) as engine:
        [output] = engine.generate(["a"], SamplingParams(num_inference_steps=2, seed=0))
    assert output.ok and output.metrics is not None
    assert output.metrics.peak_memory_mb is None
    assert output.metrics.stage_durations["denoise"] > 0
