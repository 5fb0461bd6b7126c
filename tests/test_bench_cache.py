"""The cache benchmark runs end to end at a tiny size (its numbers mean little here)."""

from __future__ import annotations

from diffusion_runtime.bench.cache import run
from diffusion_runtime.cli import BENCHMARKS


def test_the_cache_benchmark_reports_the_curve_and_the_mixed_batch() -> None:
    assert BENCHMARKS["cache"] == "diffusion_runtime.bench.cache:run"
    result = run(requests=4, steps=6, rounds=1, thresholds=(0.0, 0.5))
    curve = result["curve"]
    assert set(curve) == {"uncached", "0", "0.5"}
    assert curve["0"]["skipped_fraction"] == 0.0 and curve["0"]["fewer_evaluations"] == 1.0
    assert curve["0"]["recognition"] == curve["uncached"]["recognition"]
    assert curve["0.5"]["skipped_fraction"] > 0 and curve["0.5"]["fewer_evaluations"] > 1
    mixed = result["mixed_step_batch"]
    assert (
        set(mixed["images_per_s"]) == set(mixed["images_per_cpu_s"]) == {"uncached", "half_cached"}
    )
    assert all(point["images_per_cpu_s"] > 0 for point in curve.values())
    assert 0 < mixed["skipped_fraction"] < 1
