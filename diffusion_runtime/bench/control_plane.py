"""Control-plane cost: what the engine adds per request, and how it grows with queue depth.

A pipeline that does almost nothing (``testing-null``) runs through the real
engine (uni executor, request mode). For each queue depth D, one ``generate``
call submits D requests at once, so the queue starts D deep; the cost per
request lifecycle is the call's wall time over D (admission, two transitions,
scheduling, the runner, delivery), repeated until enough requests have run and
reported as the median over repeats. The ratio to calling the same pipeline
directly (fused batches of ``max_num_seqs``, no engine) is measured in the same run.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from diffusion_runtime.bench.stats import Stopwatch
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.pipelines.registry import build_pipeline
from diffusion_runtime.sampling_params import SamplingParams


def engine_cost_per_request_us(
    engine: DiffusionEngine, depth: int, min_requests: int, params: SamplingParams
) -> list[float]:
    """Per-request cost (µs) of each ``generate`` call of ``depth`` prompts."""
    prompts = ["0"] * depth
    samples: list[float] = []
    done = 0
    while done < min_requests or len(samples) < 3:
        watch = Stopwatch()
        outputs = engine.generate(prompts, params)
        samples.append(watch.seconds() / depth * 1e6)
        assert all(o.ok for o in outputs)
        done += depth
    return samples


def direct_cost_per_request_us(
    pipeline: Any, batch_size: int, count: int, params: SamplingParams
) -> float:
    """Per-request cost (µs) of calling the pipeline directly in fused batches."""
    device = torch.device("cpu")
    watch = Stopwatch()
    with torch.inference_mode():
        for first in range(0, count, batch_size):
            batch = [
                PipelineRequest(f"r{i}", "0", params, i, device)
                for i in range(first, min(first + batch_size, count))
            ]
            pipeline.forward(batch)
    return watch.seconds() / count * 1e6


def tracing_cost(max_num_seqs: int, pipeline: str, params: SamplingParams) -> dict[str, Any]:
    """Per-request cost with tracing off, writing a JSON-lines trace, and auditing online."""
    variants: dict[str, dict[str, Any]] = {
        "off": {},
        "trace_file": {"trace_path": None},
        "online_audit": {"audit": "report"},
    }
    costs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            if "trace_path" in extra:
                extra = {"trace_path": str(Path(tmp) / "trace.jsonl")}
            config = EngineConfig(
                pipeline=pipeline, max_num_seqs=max_num_seqs, device="cpu", warmup=False, **extra
            )
            with DiffusionEngine.make_engine(config) as engine:
                engine_cost_per_request_us(engine, 1_000, 2_000, params)
                costs[name] = statistics.median(
                    engine_cost_per_request_us(engine, 1_000, 10_000, params)
                )
    off = costs.pop("off")
    return {
        "off_us_per_request": round(off, 2),
        **{f"{name}_us_per_request": round(cost, 2) for name, cost in costs.items()},
        **{f"{name}_over_off": round(cost / off, 3) for name, cost in costs.items()},
    }


def run(
    depths: tuple[int, ...] = (10, 1_000, 100_000),
    max_num_seqs: int = 8,
    min_requests: int = 20_000,
    pipeline: str = "testing-null",
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=1, seed=0)
    config = EngineConfig(pipeline=pipeline, max_num_seqs=max_num_seqs, device="cpu", warmup=False)
    direct_pipeline = build_pipeline(pipeline, torch.device("cpu"), {})
    results: dict[str, Any] = {
        "benchmark": "control_plane",
        "pipeline": pipeline,
        "executor": "uni",
        "mode": "request",
        "max_num_seqs": max_num_seqs,
        "depths": {},
    }
    with DiffusionEngine.make_engine(config) as engine:
        engine_cost_per_request_us(engine, 1_000, 5_000, params)  # warm caches and allocators
        for depth in depths:
            samples = engine_cost_per_request_us(engine, depth, max(min_requests, depth), params)
            direct = direct_cost_per_request_us(direct_pipeline, max_num_seqs, 20_000, params)
            median = statistics.median(samples)
            results["depths"][str(depth)] = {
                "engine_us_per_request_median": round(median, 2),
                "engine_us_per_request_min": round(min(samples), 2),
                "direct_us_per_request": round(direct, 2),
                "engine_throughput_over_direct": round(direct / median, 4),
                "repeats": len(samples),
            }
    results["tracing"] = tracing_cost(max_num_seqs, pipeline, params)
    by_depth = results["depths"]
    first, last = str(depths[0]), str(depths[-1])
    results["growth_deepest_over_shallowest"] = round(
        by_depth[last]["engine_us_per_request_median"]
        / by_depth[first]["engine_us_per_request_median"],
        3,
    )
    return results
