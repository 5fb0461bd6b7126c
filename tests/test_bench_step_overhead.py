"""The step-overhead benchmark runs end to end at tiny sizes (its numbers mean nothing here)."""

from __future__ import annotations

import torch

from diffusion_runtime.bench.step_overhead import free_network_digits, run
from diffusion_runtime.cli import BENCHMARKS


def test_the_step_overhead_benchmark_reports_both_modes() -> None:
    assert BENCHMARKS["step-overhead"] == "diffusion_runtime.bench.step_overhead:run"
    result = run(batches=(2,), steps=2, rounds=1)
    [costs] = result["us_per_request_step"].values()
    assert set(costs) == {"step_mode_us", "request_mode_us"}
    assert all(cost > 0 for cost in costs.values())


def test_the_free_network_answers_zeros() -> None:
    pipeline = free_network_digits()
    x = torch.ones(3, 64)
    noise = pipeline.model.predict_noise_row_stable(x, torch.zeros(3), torch.zeros(3), 32)
    assert torch.equal(noise, torch.zeros_like(x))
