"""Step mode vs request mode on the same Poisson arrivals of short and long requests.

Requests arrive as a Poisson process; most are short (few denoising steps),
some are long. Both modes serve the identical arrival trace with the digits
pipeline through the real engine. Reported per mode: p50/p99 latency (arrival
to final output) of short requests and of all requests, and throughput.
Request mode cannot batch requests with different step counts and runs each
wave to the end, so a short request can wait behind a long wave; step mode
lets it join the running batch at the next step and leave when it is done.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from typing import Any

from diffusion_runtime.bench.stats import Stopwatch, percentile
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.sampling_params import SamplingParams


def make_trace(
    count: int,
    rate_per_s: float,
    short_steps: int,
    long_steps: int,
    long_fraction: float,
    seed: int,
) -> list[tuple[float, int]]:
    """``(arrival offset in s, step count)`` for each request."""
    rng = random.Random(seed)
    t = 0.0
    trace = []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        trace.append((t, long_steps if rng.random() < long_fraction else short_steps))
    return trace


async def replay(engine: DiffusionEngine, trace: list[tuple[float, int]]) -> dict[str, Any]:
    latencies: list[tuple[int, float]] = []
    clock = Stopwatch()

    async def one(index: int, offset: float, steps: int) -> None:
        await asyncio.sleep(max(0.0, offset - clock.seconds()))
        arrived = Stopwatch()
        params = SamplingParams(num_inference_steps=steps, seed=index)
        rid = await engine.add_request(str(index % 10), params)
        async for out in engine.stream(rid):
            if out.finished:
                assert out.ok, out.error
        latencies.append((steps, arrived.seconds()))

    await asyncio.gather(*(one(i, offset, steps) for i, (offset, steps) in enumerate(trace)))
    wall = clock.seconds()
    short = min(steps for _, steps in trace)
    short_lat = [lat for steps, lat in latencies if steps == short]
    all_lat = [lat for _, lat in latencies]
    return {
        "short_p50_ms": round(percentile(short_lat, 50) * 1e3, 1),
        "short_p99_ms": round(percentile(short_lat, 99) * 1e3, 1),
        "all_p50_ms": round(percentile(all_lat, 50) * 1e3, 1),
        "all_p99_ms": round(percentile(all_lat, 99) * 1e3, 1),
        "mean_ms": round(statistics.fmean(all_lat) * 1e3, 1),
        "throughput_rps": round(len(trace) / wall, 1),
    }


def compare(trace: list[tuple[float, int]], max_num_seqs: int) -> dict[str, Any]:
    """Replay one trace through a request-mode and a step-mode engine."""
    results: dict[str, Any] = {}
    for mode in ("request", "step"):
        config = EngineConfig(
            pipeline="digits", device="cpu", max_num_seqs=max_num_seqs, execution_mode=mode
        )
        with DiffusionEngine.make_engine(config) as engine:
            results[mode] = asyncio.run(replay(engine, trace))
    request, step = results["request"], results["step"]
    results["short_p99_request_over_step"] = round(
        request["short_p99_ms"] / step["short_p99_ms"], 2
    )
    results["throughput_step_over_request"] = round(
        step["throughput_rps"] / request["throughput_rps"], 3
    )
    return results


def run(
    rates_per_s: tuple[float, ...] = (10.0, 40.0),
    count: int = 200,
    short_steps: int = 10,
    long_steps: int = 100,
    long_fraction: float = 0.2,
    max_num_seqs: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """One comparison per arrival rate: a light load, and one request mode cannot keep up with."""
    return {
        "benchmark": "step_vs_request",
        "pipeline": "digits",
        "requests": count,
        "steps": {"short": short_steps, "long": long_steps, "long_fraction": long_fraction},
        "max_num_seqs": max_num_seqs,
        "by_arrival_rate": {
            str(rate): compare(
                make_trace(count, rate, short_steps, long_steps, long_fraction, seed),
                max_num_seqs,
            )
            for rate in rates_per_s
        },
    }
