"""The GPU benchmark runs end to end on the CPU at tiny sizes (its numbers mean nothing here)."""

from __future__ import annotations

import attrs
import pytest

from diffusion_runtime.cli import BENCHMARKS


def test_the_gpu_benchmark_reports_every_way_at_tiny_sizes() -> None:
    pytest.importorskip("diffusers")
    from diffusion_runtime.bench.gpu import TINY, run

    assert BENCHMARKS["gpu"] == "diffusion_runtime.bench.gpu:run"
    sizes = attrs.evolve(TINY, concurrency=(2,), digits_batches=(2,))
    result = run(sizes, device="cpu")
    assert result["device"] == "cpu" and set(result["digits"]) == {"2"}
    [row] = result["dit"].values()
    assert set(row["images_per_s"]) == {
        "pipe_batched",
        "pipe_sequential",
        "engine_overlap_on",
        "engine_overlap_off",
    }
    assert all(rate > 0 for rate in row["images_per_s"].values())
    assert row["engine_over_pipe_batched"] > 0 and row["overlap_on_over_off"] > 0
