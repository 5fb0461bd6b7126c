"""Benchmarks, reachable as ``diffusion-runtime bench NAME`` and from ``benchmarks/``."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusion_runtime.engine import DiffusionEngine


def summary_us(samples_s: list[float]) -> dict[str, float]:
    """Median and 90th percentile of samples in seconds, in microseconds."""
    ordered = sorted(samples_s)
    return {
        "median_us": round(statistics.median(ordered) * 1e6, 1),
        "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 1),
    }


def interleaved_generate_rates(
    engines: dict[str, DiffusionEngine], prompts: list[Any], params: Any, repeats: int
) -> dict[str, float]:
    """Median requests/s of one ``generate(prompts, params)`` call per engine, timed in
    interleaved rounds (so machine load hits every engine alike); every output must be ok."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            rates[name].append(len(prompts) / (time.perf_counter() - start))
            assert all(o.ok for o in outputs)
    return {name: statistics.median(r) for name, r in rates.items()}
