"""Benchmarks, reachable as ``diffusion-runtime bench NAME`` and from ``benchmarks/``."""

from __future__ import annotations

import statistics


def summary_us(samples_s: list[float]) -> dict[str, float]:
    """Median and 90th percentile of samples in seconds, in microseconds."""
    ordered = sorted(samples_s)
    return {
        "median_us": round(statistics.median(ordered) * 1e6, 1),
        "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e6, 1),
    }
