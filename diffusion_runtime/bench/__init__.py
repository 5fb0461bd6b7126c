"""Benchmarks, reachable as ``diffusion-runtime bench NAME`` and from ``benchmarks/``."""

from __future__ import annotations

import functools
import statistics
from typing import TYPE_CHECKING, Any

from diffusion_runtime.bench.stats import interleaved_seconds

if TYPE_CHECKING:
    from diffusion_runtime.engine import DiffusionEngine


def interleaved_generate_rates(
    engines: dict[str, DiffusionEngine], prompts: list[Any], params: Any, repeats: int
) -> dict[str, float]:
    """Median requests/s of one ``generate(prompts, params)`` call per engine, timed in
    interleaved rounds (so machine load hits every engine alike); every output must be ok."""
    ways = {
        name: functools.partial(_generate_ok, engine, prompts, params)
        for name, engine in engines.items()
    }
    seconds = interleaved_seconds(ways, repeats)
    return {
        name: statistics.median(len(prompts) / s for s in samples)
        for name, samples in seconds.items()
    }


def _generate_ok(engine: DiffusionEngine, prompts: list[Any], params: Any) -> None:
    outputs = engine.generate(prompts, params)
    assert all(o.ok for o in outputs)
