"""The parallel benchmark runs end to end at a tiny size (its numbers mean little here)."""

from __future__ import annotations

import pytest

from diffusion_runtime.bench.parallel import run
from diffusion_runtime.cli import BENCHMARKS


def test_the_parallel_benchmark_reports_both_sides_on_digits() -> None:
    assert BENCHMARKS["parallel"] == "diffusion_runtime.bench.parallel:run"
    result = run(requests=2, steps=2, rounds=1, workloads=("digits",), threads=2, device="cpu")
    table = result["workloads"]["digits"]
    for side in ("one_rank", "one_rank_half_threads", "cfg_2"):
        assert table[side]["images_per_s"] > 0 and table[side]["cpu_s_per_image"] > 0
    assert table["cfg_2_over_one_rank"] > 0 and table["cpu_s_cfg_2_over_one_rank"] > 0
    assert table["max_abs_diff"] == {"cfg_2": 0.0}  # digits rows are batch-invariant
    assert "ulysses_2" not in table  # the sequence splits run on the DiT only


def test_an_unknown_workload_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown workload 'dit-x'"):
        run(workloads=("dit-x",), device="cpu")
