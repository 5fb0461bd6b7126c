"""The engine on a GPU against direct calls, side by side (tiny sizes on a CPU).

Two comparisons, each timed in interleaved rounds in one process (best round
kept, ratios computed from those):

- digits: B requests through a request-mode engine against one direct
  ``pipeline.forward`` of the same B requests, at each batch size;
- a DiT (DiT-XL/2 at 256x256 on CUDA: 28 layers, 16 heads of 72, patch 2,
  32x32x4 latents, the Stable Diffusion VAE; random weights built from config,
  nothing downloaded) served four ways at each concurrency N: one hand-batched
  ``pipe(class_labels=[N labels])``; N ``pipe()`` calls in sequence (only up to
  ``sequential_upto``); a step-mode engine with ``max_num_seqs=N`` and the
  N requests submitted at once, with two-phase output overlap on, and off.

Needs the ``diffusers`` extra. ``diffusion-runtime bench gpu`` runs the full
sizes when torch sees a CUDA device and the tiny ones otherwise.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, cast

import attrs
import torch

from diffusion_runtime.bench.stats import interleaved_seconds
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.pipelines.digits import DigitsPipeline
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.sampling_params import SamplingParams


@attrs.frozen
class DitShape:
    """The transformer and VAE sizes of a DiT built from config."""

    num_layers: int
    num_attention_heads: int
    attention_head_dim: int
    latent_size: int
    vae_channels: tuple[int, ...]


@attrs.frozen
class GpuBenchSizes:
    """What one run measures: model sizes, concurrencies, steps and rounds."""

    dit: DitShape
    concurrency: tuple[int, ...]
    sequential_upto: int
    steps: int
    guidance_scale: float
    digits_batches: tuple[int, ...]
    digits_steps: int
    repeats: int


DIT_XL_2_256 = DitShape(28, 16, 72, 32, (128, 256, 512, 512))

FULL = GpuBenchSizes(
    dit=DIT_XL_2_256,
    concurrency=(1, 8, 32),
    sequential_upto=8,
    steps=25,
    guidance_scale=4.0,
    digits_batches=(1, 8, 64),
    digits_steps=25,
    repeats=3,
)

TINY = GpuBenchSizes(
    dit=DitShape(2, 2, 16, 8, (8, 16)),
    concurrency=(1, 2),
    sequential_upto=2,
    steps=2,
    guidance_scale=4.0,
    digits_batches=(1, 2),
    digits_steps=2,
    repeats=1,
)


def build_dit(shape: DitShape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight ``DiTPipeline`` of ``shape``, built directly on ``device``."""
    diffusers = importlib.import_module("diffusers")
    torch.manual_seed(seed)
    with device:
        transformer = diffusers.DiTTransformer2DModel(
            num_attention_heads=shape.num_attention_heads,
            attention_head_dim=shape.attention_head_dim,
            in_channels=4,
            out_channels=8,
            num_layers=shape.num_layers,
            sample_size=shape.latent_size,
            patch_size=2,
            norm_num_groups=min(32, shape.vae_channels[0] // 2),
        )
        vae = diffusers.AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * len(shape.vae_channels),
            up_block_types=("UpDecoderBlock2D",) * len(shape.vae_channels),
            block_out_channels=shape.vae_channels,
            layers_per_block=2,
            latent_channels=4,
            norm_num_groups=min(32, shape.vae_channels[0] // 2),
            sample_size=shape.latent_size * 2 ** (len(shape.vae_channels) - 1),
        )
    pipe = diffusers.DiTPipeline(
        transformer=transformer.to(dtype).eval(),
        vae=vae.to(dtype).eval(),
        scheduler=diffusers.DDIMScheduler(num_train_timesteps=1000),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _synchronized(device: torch.device, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        value = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return value

    return call


def _best_of(ways: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each way once untimed, then ``repeats`` interleaved timed rounds; best seconds each."""
    seconds = interleaved_seconds(ways, repeats, warmup_rounds=1)
    return {name: min(samples) for name, samples in seconds.items()}


def digits(sizes: GpuBenchSizes, device: torch.device) -> dict[str, Any]:
    """Digits: a request-mode engine against the pipeline called directly."""
    params = SamplingParams(num_inference_steps=sizes.digits_steps, seed=0)
    pipeline = DigitsPipeline(device)
    by_batch = {}
    for batch in sizes.digits_batches:
        prompts = [str(i % 10) for i in range(batch)]
        requests = [PipelineRequest(f"r{i}", p, params, i, device) for i, p in enumerate(prompts)]

        def direct(requests: list[PipelineRequest] = requests) -> Any:
            with torch.inference_mode():
                produced = pipeline.forward(requests).items()
                return {rid: cast(torch.Tensor, image).cpu() for rid, image in produced}

        config = EngineConfig(pipeline="digits", device=str(device), max_num_seqs=batch)
        with DiffusionEngine.make_engine(config) as engine:
            best = _best_of(
                {
                    "direct": _synchronized(device, direct),
                    "engine": _synchronized(
                        device, functools.partial(engine.generate, prompts, params)
                    ),
                },
                sizes.repeats,
            )
        by_batch[str(batch)] = {
            "images_per_s": {name: round(batch / s, 1) for name, s in best.items()},
            "engine_over_direct": round(best["direct"] / best["engine"], 3),
        }
    return by_batch


def dit(sizes: GpuBenchSizes, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The DiT four ways at each concurrency."""
    pipe = build_dit(sizes.dit, device, dtype)
    steps, guidance = sizes.steps, sizes.guidance_scale

    def pipe_call(labels: list[int], seed: int) -> torch.Tensor:
        images = pipe(
            class_labels=labels,
            generator=torch.Generator(device).manual_seed(seed),
            num_inference_steps=steps,
            guidance_scale=guidance,
            output_type="np",
        ).images
        return torch.as_tensor(images)

    def pipe_sequential(labels: list[int]) -> list[torch.Tensor]:
        return [pipe_call([label], seed) for seed, label in enumerate(labels)]

    by_concurrency = {}
    for n in sizes.concurrency:
        labels = [i % 1000 for i in range(n)]
        params = [
            SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=i)
            for i in range(n)
        ]

        def engine_config(overlap: bool, n: int = n) -> EngineConfig:
            return EngineConfig(
                pipeline=lambda device: DiffusersPipeline(pipe, device),
                device=str(device),
                max_num_seqs=n,
                execution_mode="step",
                overlap_outputs=overlap,
            )

        with (
            DiffusionEngine.make_engine(engine_config(True)) as overlapped,
            DiffusionEngine.make_engine(engine_config(False)) as waiting,
        ):
            ways: dict[str, Callable[[], Any]] = {
                "pipe_batched": functools.partial(pipe_call, labels, 0),
                "engine_overlap_on": functools.partial(overlapped.generate, labels, params),
                "engine_overlap_off": functools.partial(waiting.generate, labels, params),
            }
            if n <= sizes.sequential_upto:
                ways["pipe_sequential"] = functools.partial(pipe_sequential, labels)
            best = _best_of({k: _synchronized(device, w) for k, w in ways.items()}, sizes.repeats)
        engine = best["engine_overlap_on"]
        row: dict[str, Any] = {
            "images_per_s": {name: round(n / s, 2) for name, s in best.items()},
            "engine_over_pipe_batched": round(best["pipe_batched"] / engine, 3),
            "overlap_on_over_off": round(best["engine_overlap_off"] / engine, 3),
        }
        if "pipe_sequential" in best:
            row["engine_over_pipe_sequential"] = round(best["pipe_sequential"] / engine, 3)
        by_concurrency[str(n)] = row
    return by_concurrency


def run(sizes: GpuBenchSizes | None = None, device: str | None = None) -> dict[str, Any]:
    """Both comparisons as a JSON-able dict (full sizes on CUDA, tiny on the CPU by default)."""
    on_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    where = torch.device(device or ("cuda" if on_cuda else "cpu"))
    chosen = sizes or (FULL if on_cuda else TINY)
    dtype = torch.float16 if where.type == "cuda" else torch.float32
    return {
        "benchmark": "gpu",
        "device": torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sizes": attrs.asdict(chosen),
        "dit_dtype": str(dtype),
        "digits": digits(chosen, where),
        "dit": dit(chosen, where, dtype),
    }
