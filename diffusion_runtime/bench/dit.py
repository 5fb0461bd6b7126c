"""A tiny DiT through the engine in step mode vs diffusers' own ``pipe()``, side by side.

For each batch size B, the same B class-label requests (one image each,
their own seeds) are served four ways, interleaved within one run: by one
hand-batched ``pipe(class_labels=[...B], generator=[...B])`` call, the bar a
serving engine has to meet; by a step-mode engine with ``max_num_seqs=B``,
where the requests share every denoising step (one transformer call and one
scheduler step per step for all of them); by the same engine with the
transformer called on fixed-size chunks of ``rows_per_call`` rows, which
makes every image independent of its batch mates; and by diffusers calling
``pipe()`` once per request in sequence. The headline is engine / hand-batched
throughput. Also reported: how far the engine's images are from diffusers'
sequential ones (bit-identical at B = 1 without fixed chunks; batch mates
change CPU GEMM rounding otherwise) and whether they equal the hand-batched
ones. The model has random weights built from config: nothing is downloaded.
Needs the ``diffusers`` extra.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from diffusion_runtime.bench.stats import interleaved_seconds
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.pipelines.diffusers.tiny import tiny_dit
from diffusion_runtime.sampling_params import SamplingParams


def diffusers_sequential(pipe: Any, labels: list[int], steps: int, guidance: float) -> torch.Tensor:
    """Each request through ``pipe()`` alone, one after another."""
    images = [
        pipe(
            class_labels=[label],
            generator=torch.Generator().manual_seed(label),
            num_inference_steps=steps,
            guidance_scale=guidance,
            output_type="pt",
        ).images
        for label in labels
    ]
    return torch.cat(images)


def diffusers_hand_batched(
    pipe: Any, labels: list[int], steps: int, guidance: float
) -> torch.Tensor:
    """All requests through one ``pipe()`` call, each with its own generator."""
    images: torch.Tensor = pipe(
        class_labels=labels,
        generator=[torch.Generator().manual_seed(label) for label in labels],
        num_inference_steps=steps,
        guidance_scale=guidance,
        output_type="pt",
    ).images
    return images


def engine_batched(
    engine: DiffusionEngine, labels: list[int], steps: int, guidance: float
) -> torch.Tensor:
    """All requests submitted at once to a step-mode engine."""
    params = [
        SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=label)
        for label in labels
    ]
    outputs = engine.generate(labels, params)
    assert all(out.ok and out.image_batch is not None for out in outputs)
    return torch.cat([out.image_batch for out in outputs if out.image_batch is not None])


def compare(
    pipe: Any, batch: int, steps: int, guidance: float, rows_per_call: int, repeats: int
) -> dict[str, Any]:
    """The four ways, interleaved ``repeats`` times after one untimed round; medians."""
    labels = list(range(batch))

    def engine(rows: int | None) -> DiffusionEngine:
        config = EngineConfig(
            pipeline=lambda device: DiffusersPipeline(pipe, device, rows_per_call=rows),
            device="cpu",
            max_num_seqs=batch,
            execution_mode="step",
        )
        return DiffusionEngine.make_engine(config)

    with engine(None) as plain, engine(rows_per_call) as fixed:
        ways: dict[str, Callable[[], torch.Tensor]] = {
            "hand_batched": lambda: diffusers_hand_batched(pipe, labels, steps, guidance),
            "engine": lambda: engine_batched(plain, labels, steps, guidance),
            "engine_fixed_rows": lambda: engine_batched(fixed, labels, steps, guidance),
            "sequential": lambda: diffusers_sequential(pipe, labels, steps, guidance),
        }
        images = {name: way() for name, way in ways.items()}
        times = interleaved_seconds(ways, repeats)
    rate = {name: batch / statistics.median(samples) for name, samples in times.items()}
    expected = images["sequential"]
    return {
        "engine_over_hand_batched": round(rate["engine"] / rate["hand_batched"], 3),
        "engine_fixed_rows_over_hand_batched": round(
            rate["engine_fixed_rows"] / rate["hand_batched"], 3
        ),
        "engine_over_sequential": round(rate["engine"] / rate["sequential"], 2),
        **{f"{name}_images_per_s": round(value, 1) for name, value in rate.items()},
        "engine_bit_identical_to_sequential": torch.equal(images["engine"], expected),
        "engine_max_abs_diff": float((images["engine"] - expected).abs().max()),
        "engine_fixed_rows_max_abs_diff": float(
            (images["engine_fixed_rows"] - expected).abs().max()
        ),
        "hand_batched_max_abs_diff": float((images["hand_batched"] - expected).abs().max()),
        "engine_bit_identical_to_hand_batched": torch.equal(
            images["engine"], images["hand_batched"]
        ),
    }


def run(
    batches: tuple[int, ...] = (1, 8, 32),
    steps: int = 25,
    guidance: float = 4.0,
    latent_size: int = 16,
    rows_per_call: int = 8,
    repeats: int = 5,
) -> dict[str, Any]:
    """Throughput of the four ways at each batch size, as a JSON-able dict."""
    pipe = tiny_dit(latent_size)
    return {
        "benchmark": "dit",
        "model": f"tiny random DiT, {latent_size}x{latent_size}x4 latents, "
        f"{2 * latent_size}x{2 * latent_size} images",
        "steps": steps,
        "guidance_scale": guidance,
        "rows_per_call": rows_per_call,
        "torch_threads": torch.get_num_threads(),
        "by_batch": {
            str(batch): compare(pipe, batch, steps, guidance, rows_per_call, repeats)
            for batch in batches
        },
    }
