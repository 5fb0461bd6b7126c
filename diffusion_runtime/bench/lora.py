"""LoRA adapters on the digits model in step mode: mixed-adapter step batches vs
waves split by adapter, and what an adapter costs against the base model.

``requests`` concurrent requests cycle over ``adapters`` random adapters plus
the base model (no adapter). They are served two ways by one step-mode
engine (``max_loras = adapters``), interleaved within one run:

- **mixed**: all requests in one ``generate`` call; they share every
  denoising step, each row with its own adapter (one network pass per step);
- **split**: one ``generate`` call per adapter group (the base model's
  requests form a group too), one group after another, as an engine whose
  step batch key held the adapter would run them.

Throughputs come from the medians of the rounds. Then, at each batch size of
``cost_batches``, one adapter for every request is timed against the same
requests with no adapter, on an engine with adapters off (the base model as
it runs without LoRA support) and on the LoRA engine (base rows there skip
the adapter path).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffusion_runtime.bench.stats import interleaved_seconds
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.lora.weights import save_adapter
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.digits.model import DenoiserConfig, DigitDenoiser
from diffusion_runtime.sampling_params import SamplingParams


def write_random_adapters(directory: Path, count: int, rank: int) -> list[LoRARequest]:
    """``count`` random rank-``rank`` adapters on every linear layer of the digits network
    (their content does not change their cost), with ids ``1..count``."""
    linears = [
        (name, module)
        for name, module in DigitDenoiser(DenoiserConfig()).named_modules()
        if isinstance(module, nn.Linear)
    ]
    loras = []
    for adapter_id in range(1, count + 1):
        generator = torch.Generator().manual_seed(adapter_id)
        layers = {
            name: (
                torch.randn(rank, m.in_features, generator=generator) * 0.05,
                torch.randn(m.out_features, rank, generator=generator) * 0.05,
            )
            for name, m in linears
        }
        path = directory / f"adapter-{adapter_id}.safetensors"
        save_adapter(path, layers)
        loras.append(LoRARequest(f"adapter-{adapter_id}", adapter_id, str(path)))
    return loras


def batch_params(loras: list[LoRARequest | None], steps: int) -> list[SamplingParams]:
    """One request per entry of ``loras``, seeded by position."""
    return [
        SamplingParams(num_inference_steps=steps, seed=i, lora=lora) for i, lora in enumerate(loras)
    ]


def run_split(
    engine: DiffusionEngine, prompts: list[str], params: list[SamplingParams]
) -> list[RequestOutput]:
    """The requests one adapter group after another; their outputs in request order."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(0 if p.lora is None else p.lora.adapter_id, []).append(i)
    outputs: dict[int, RequestOutput] = {}
    for members in groups.values():
        done = engine.generate([prompts[i] for i in members], [params[i] for i in members])
        outputs.update(zip(members, done, strict=True))
    return [outputs[i] for i in range(len(params))]


def step_config(requests: int, max_loras: int) -> EngineConfig:
    return EngineConfig(
        pipeline="digits",
        device="cpu",
        execution_mode="step",
        max_num_seqs=requests,
        max_loras=max_loras,
    )


def mixed_vs_split(
    loras: list[LoRARequest], requests: int, steps: int, rounds: int
) -> dict[str, Any]:
    """Mixed-adapter step batches against waves split by adapter, on one engine."""
    choices: list[LoRARequest | None] = [None, *loras]
    params = batch_params([choices[i % len(choices)] for i in range(requests)], steps)
    prompts = [str(i % 10) for i in range(requests)]
    with DiffusionEngine.make_engine(step_config(requests, len(loras))) as engine:
        ways: dict[str, Callable[[], object]] = {
            "mixed": functools.partial(engine.generate, prompts, params),
            "split": functools.partial(run_split, engine, prompts, params),
        }
        timings = interleaved_seconds(ways, rounds, warmup_rounds=1)
    per_s = {name: requests / statistics.median(samples) for name, samples in timings.items()}
    return {
        "requests_per_s": {name: round(value, 1) for name, value in per_s.items()},
        "median_ms": {name: round(statistics.median(s) * 1e3, 1) for name, s in timings.items()},
        "mixed_over_split": round(per_s["mixed"] / per_s["split"], 2),
    }


def adapter_cost(lora: LoRARequest, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """``batch`` requests with one adapter against the same without one."""
    prompts = [str(i % 10) for i in range(batch)]
    base = batch_params([None] * batch, steps)
    adapted = batch_params([lora] * batch, steps)
    with (
        DiffusionEngine.make_engine(step_config(batch, 0)) as plain,
        DiffusionEngine.make_engine(step_config(batch, 1)) as engine,
    ):
        ways: dict[str, Callable[[], object]] = {
            "base_lora_off": functools.partial(plain.generate, prompts, base),
            "base_lora_on": functools.partial(engine.generate, prompts, base),
            "adapter": functools.partial(engine.generate, prompts, adapted),
        }
        timings = interleaved_seconds(ways, rounds, warmup_rounds=1)
    medians = {name: statistics.median(samples) for name, samples in timings.items()}
    return {
        "median_ms": {name: round(value * 1e3, 1) for name, value in medians.items()},
        "adapter_over_base": round(medians["adapter"] / medians["base_lora_off"], 2),
        "base_lora_on_over_off": round(medians["base_lora_on"] / medians["base_lora_off"], 2),
    }


def run(
    requests: int = 8,
    adapters: int = 4,
    rank: int = 8,
    steps: int = 20,
    rounds: int = 7,
    cost_batches: tuple[int, ...] = (1, 8),
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        loras = write_random_adapters(Path(directory), adapters, rank)
        return {
            "benchmark": "lora",
            "pipeline": "digits",
            "requests": requests,
            "adapters": adapters,
            "rank": rank,
            "steps": steps,
            "rounds": rounds,
            "mixed_vs_split": mixed_vs_split(loras, requests, steps, rounds),
            "adapter_cost_by_batch": {
                str(batch): adapter_cost(loras[0], batch, steps, rounds) for batch in cost_batches
            },
        }
