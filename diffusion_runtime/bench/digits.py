"""Digits throughput: the engine against the pipeline called directly, side by side.

For each batch size B, B requests (25 steps, one image each) run as

- one direct ``pipeline.forward`` of the B requests on the calling thread;
- one ``generate`` call through a request-mode engine with the uni executor
  (``max_num_seqs=B``), which drives the core on the calling thread;
- the same through the mp executor with one worker process;
- B ``add_request`` calls read with ``stream`` on an asyncio loop (uni), where
  the engine's loop thread drives the core;
- and, apart, the async API and ``generate()`` each in a fresh process of its
  own (``async_over_generate_alone``), as a server that uses only one of them runs.

The four are timed in interleaved rounds, in one process, and the best round
of each is kept; ratios compare them. The async variant runs torch on a second
thread of a process whose main thread has its own OpenMP team, which libgomp
slows down (see the user guide), so ``async_over_generate`` is a lower bound:
in a process that uses only the async API it matches ``generate()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import multiprocessing
from collections.abc import Callable
from typing import Any

import torch

from diffusion_runtime.bench.stats import call_seconds, interleaved_seconds
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.pipelines.digits import DigitsPipeline
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.sampling_params import SamplingParams


def read_all_async(engine: DiffusionEngine, prompts: list[str], params: SamplingParams) -> None:
    async def run() -> None:
        ids = [await engine.add_request(p, params) for p in prompts]
        for rid in ids:
            async for _ in engine.stream(rid):
                pass

    asyncio.run(run())


def best_alone(api: str, size: int, steps: int, repeats: int) -> float:
    """Best seconds for ``size`` requests through one API ("generate" or "async")
    in this process, which is meant to be fresh: its main thread runs no other torch."""
    params = SamplingParams(num_inference_steps=steps, seed=0)
    prompts = [str(i % 10) for i in range(size)]
    config = EngineConfig(pipeline="digits", device="cpu", max_num_seqs=size)
    with DiffusionEngine.make_engine(config) as engine:
        if api == "async":
            return min(
                call_seconds(functools.partial(read_all_async, engine, prompts, params), repeats)
            )
        return min(call_seconds(functools.partial(engine.generate, prompts, params), repeats))


def async_over_generate_alone(size: int, steps: int, repeats: int, rounds: int = 2) -> float:
    """The async API against ``generate()``, each in a process of its own (one
    OpenMP team each), alternating processes; the best of ``rounds`` each."""
    spawn = multiprocessing.get_context("spawn")
    best = {"generate": float("inf"), "async": float("inf")}
    for _ in range(rounds):
        for api in best:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                seconds = pool.submit(best_alone, api, size, steps, repeats).result()
            best[api] = min(best[api], seconds)
    return round(best["generate"] / best["async"], 3)


def run(
    batch_sizes: tuple[int, ...] = (1, 8, 64), steps: int = 25, repeats: int = 7
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps, seed=0)
    pipeline = DigitsPipeline("cpu")
    results: dict[str, Any] = {"benchmark": "digits", "steps": steps, "batches": {}}
    for size in batch_sizes:
        prompts = [str(i % 10) for i in range(size)]
        requests = [
            PipelineRequest(f"r{i}", p, params, i, torch.device("cpu"))
            for i, p in enumerate(prompts)
        ]

        def direct(requests: list[PipelineRequest] = requests) -> None:
            with torch.inference_mode():
                pipeline.forward(requests)

        def config(backend: str, size: int = size) -> EngineConfig:
            return EngineConfig(
                pipeline="digits", device="cpu", max_num_seqs=size, executor_backend=backend
            )

        with (
            DiffusionEngine.make_engine(config("uni")) as uni,
            DiffusionEngine.make_engine(config("mp")) as mp,
            DiffusionEngine.make_engine(config("uni")) as uni_async,
        ):
            batch = list(prompts)
            variants: dict[str, Callable[[], Any]] = {
                "direct": direct,
                "generate_uni": functools.partial(uni.generate, batch, params),
                "generate_mp": functools.partial(mp.generate, batch, params),
                "async_uni": functools.partial(read_all_async, uni_async, batch, params),
            }
            timings = interleaved_seconds(variants, repeats)
        best = {name: min(samples) for name, samples in timings.items()}
        per_s = {name: round(size / seconds, 1) for name, seconds in best.items()}
        results["batches"][str(size)] = {
            "images_per_s": per_s,
            "generate_over_direct": round(best["direct"] / best["generate_uni"], 3),
            "mp_over_uni": round(best["generate_uni"] / best["generate_mp"], 3),
            "async_over_generate": round(best["generate_uni"] / best["async_uni"], 3),
            "async_over_generate_alone": async_over_generate_alone(size, steps, repeats),
        }
    return results
