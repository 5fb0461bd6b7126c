"""The cache benchmark runs end to end at a tiny size (its numbers mean little here)."""

from __future__ import annotations

import pytest

from diffusion_runtime.bench.cache import run
from diffusion_runtime.cli import BENCHMARKS


def test_the_cache_benchmark_reports_the_curve_and_the_mixed_batch() -> None:
    assert BENCHMARKS["cache"] == "diffusion_runtime.bench.cache:run"
    result = run(requests=4, steps=6, rounds=1, thresholds=(0.0, 0.5), dit_requests=0)
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


def test_the_dit_part_reports_both_backends_with_psnr_against_uncached() -> None:
    pytest.importorskip("diffusers")
    from diffusion_runtime.bench.cache_dit import run_dit

    result = run_dit(requests=2, steps=6, rounds=1, thresholds=(0.0, 0.5), latent_size=8)
    curve = result["curve"]
    assert set(curve) == {
        "uncached",
        "tea_cache 0",
        "tea_cache 0.5",
        "first_block 0",
        "first_block 0.5",
    }
    for backend in ("tea_cache", "first_block"):
        assert curve[f"{backend} 0"]["psnr_db"] is None  # identical to uncached
        assert curve[f"{backend} 0"]["skipped_fraction"] == 0.0
        assert curve[f"{backend} 0.5"]["skipped_fraction"] > 0
        assert curve[f"{backend} 0.5"]["psnr_db"] is not None
    assert all(point["images_per_cpu_s"] > 0 for point in curve.values())
