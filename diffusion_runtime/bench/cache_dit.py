"""Both step caches on the tiny DiT: evaluations saved, throughput and PSNR over thresholds.

One request-mode engine (uni executor, all requests in one wave, torch on one
thread) over a random-weight DiT of ``num_layers`` blocks serves the same
class-label requests (fixed seeds, guidance 4) uncached and, per backend, once
per threshold (``SamplingParams.cache`` per request), timed in interleaved
rounds (the best kept) by wall-clock and by this process's CPU seconds.
Quality is the PSNR of the images against the same requests' uncached images
(``None``: identical). Needs the ``diffusers`` extra.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_runtime.bench.cache import _counts, _run
from diffusion_runtime.bench.stats import best_wall_and_cpu
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.pipelines.diffusers.tiny import tiny_dit
from diffusion_runtime.sampling_params import SamplingParams

BACKENDS = ("tea_cache", "first_block")
THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)


def psnr(images: torch.Tensor, reference: torch.Tensor) -> float | None:
    """``10 log10(1 / mse)`` over all pixels of all images (in ``[0, 1]``); ``None``
    when every image equals its reference."""
    mse = float((images.double() - reference.double()).pow(2).mean())
    return None if mse == 0 else 10 * math.log10(1 / mse)


def run_dit(
    requests: int = 16,
    steps: int = 25,
    rounds: int = 2,
    thresholds: Sequence[float] = THRESHOLDS,
    num_layers: int = 6,
    latent_size: int = 16,
) -> dict[str, Any]:
    pipe = tiny_dit(latent_size=latent_size, num_layers=num_layers)
    labels = list(range(requests))
    ways_settings: dict[str, dict[str, Any] | bool] = {"uncached": False}
    for backend in BACKENDS:
        for thresh in thresholds:
            ways_settings[f"{backend} {thresh:g}"] = {"backend": backend, "rel_l1_thresh": thresh}
    config = EngineConfig(
        pipeline=lambda device: DiffusersPipeline(pipe, device),
        device="cpu",
        max_num_seqs=requests,
        execution_mode="request",
        intra_op_threads=1,
    )
    outputs: dict[str, list[RequestOutput]] = {}
    with DiffusionEngine.make_engine(config) as engine:
        ways = {
            name: functools.partial(
                _run, engine, labels, _params(requests, steps, cache), outputs, name
            )
            for name, cache in ways_settings.items()
        }
        seconds = best_wall_and_cpu(ways, rounds)
    reference = _images(outputs["uncached"])
    uncached_evals, _ = _counts(outputs["uncached"])
    curve = {}
    for name in ways_settings:
        evaluations, cached = _counts(outputs[name])
        quality = psnr(_images(outputs[name]), reference)
        curve[name] = {
            "skipped_fraction": round(cached / (evaluations + cached), 3),
            "fewer_evaluations": round(uncached_evals / evaluations, 2),
            "images_per_s": round(requests / seconds[name][0], 1),
            "images_per_cpu_s": round(requests / seconds[name][1], 1),
            "psnr_db": None if quality is None else round(quality, 1),
        }
    return {
        "requests": requests,
        "steps": steps,
        "num_layers": num_layers,
        "latent_size": latent_size,
        "curve": curve,
    }


def _params(count: int, steps: int, cache: dict[str, Any] | bool) -> list[SamplingParams]:
    return [
        SamplingParams(num_inference_steps=steps, seed=i, guidance_scale=4.0, cache=cache)
        for i in range(count)
    ]


def _images(outs: Sequence[RequestOutput]) -> torch.Tensor:
    return torch.cat([out.image_batch for out in outs if out.image_batch is not None])
