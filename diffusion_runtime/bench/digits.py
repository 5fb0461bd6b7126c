"""Digits throughput: images/s alone and in batches, through the engine vs the pipeline directly.

For each batch size B, B requests (25 steps, one image each) run as one
``generate`` call through a request-mode engine with ``max_num_seqs=B``, and
as one direct ``pipeline.forward`` of the same B requests on the calling
thread; both are repeated and the best time is kept. The engine runs the
pipeline on its loop thread, measured with torch's default thread count and
with ``intra_op_threads=1`` (often faster for this small model on few cores).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.pipelines.digits import DigitsPipeline
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.sampling_params import SamplingParams


def best_of(repeats: int, fn: Any) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(
    batch_sizes: tuple[int, ...] = (1, 8, 64), steps: int = 25, repeats: int = 5
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

        through_engine = {}
        for threads in (None, 1):
            config = EngineConfig(
                pipeline="digits", device="cpu", max_num_seqs=size, intra_op_threads=threads
            )
            with DiffusionEngine.make_engine(config) as engine:
                through_engine[threads] = best_of(
                    repeats, lambda prompts=prompts: engine.generate(prompts, params)
                )
        direct_s = best_of(repeats, direct)
        results["batches"][str(size)] = {
            "direct_images_per_s": round(size / direct_s, 1),
            "engine_images_per_s": round(size / through_engine[None], 1),
            "engine_over_direct": round(direct_s / through_engine[None], 3),
            "engine_1_thread_images_per_s": round(size / through_engine[1], 1),
            "engine_1_thread_over_direct": round(direct_s / through_engine[1], 3),
        }
    return results
