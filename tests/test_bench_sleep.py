"""The sleep benchmark runs end to end at tiny sizes (its timings mean nothing here)."""

from __future__ import annotations

from diffusion_runtime.bench.sleep import run
from diffusion_runtime.cli import BENCHMARKS


def test_the_sleep_benchmark_reports_both_levels_and_the_memory_freed() -> None:
    assert BENCHMARKS["sleep"] == "diffusion_runtime.bench.sleep:run"
    result = run(rounds=1, steps=2, batch=1)
    one, two = result["level_1"], result["level_2"]
    for row in (one, two):
        assert min(row["warm_ms"], row["sleep_ms"], row["wake_ms"]) > 0
        assert row["first_after_wake_ms"] > 0 and row["weight_bytes_awake"] > 1_000_000
    # On the CPU host memory is the device: level 1 keeps the weights, level 2 frees them.
    assert one["weight_bytes_asleep"] == one["weight_bytes_awake"]
    assert two["weight_bytes_asleep"] == 0
