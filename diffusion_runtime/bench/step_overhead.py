"""What the runtime costs per request and denoising step, with a network that costs nothing.

The digits pipeline runs with its network replaced by one that returns zeros
at once, so every microsecond left is the runtime's: admission, the scheduler,
the runner, and the pipeline's own per-request bookkeeping (initial noise,
guidance rows, timesteps, the DDIM update, decoding), through the real engine
(uni executor). For each B, one ``generate`` call serves B concurrent requests
of ``steps`` steps each; the cost is its wall time over B x ``steps``, as the
median of interleaved rounds of step mode and request mode in one process.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from diffusion_runtime.bench.stats import interleaved_seconds
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.lora.layers import AdapterPlan
from diffusion_runtime.pipelines.digits import DigitsPipeline
from diffusion_runtime.pipelines.digits.model import DigitDenoiser
from diffusion_runtime.sampling_params import SamplingParams


class FreeDenoiser(DigitDenoiser):
    """The digits network's interface, answering zeros without computing anything."""

    def predict_noise_row_stable(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        labels: torch.Tensor,
        rows_per_call: int,
        adapters: AdapterPlan | None = None,
    ) -> torch.Tensor:
        return torch.zeros_like(x)


def free_network_digits(device: torch.device | str = "cpu") -> DigitsPipeline:
    """The digits pipeline with :class:`FreeDenoiser` as its network."""
    pipeline = DigitsPipeline(device)
    pipeline._model = FreeDenoiser(pipeline.config).eval()
    return pipeline


def measure(batch: int, steps: int, guidance: float, rounds: int) -> dict[str, float]:
    """µs per request-step in each mode, interleaved; medians over ``rounds``."""
    prompts = [str(i % 10) for i in range(batch)]
    params = [
        SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=i)
        for i in range(batch)
    ]

    def engine(mode: str) -> DiffusionEngine:
        config = EngineConfig(
            pipeline=free_network_digits, device="cpu", max_num_seqs=batch, execution_mode=mode
        )
        return DiffusionEngine.make_engine(config)

    def serve(engine: DiffusionEngine) -> None:
        outputs = engine.generate(prompts, params)
        assert all(out.ok for out in outputs)

    with engine("step") as step, engine("request") as request:
        times = interleaved_seconds(
            {"step": lambda: serve(step), "request": lambda: serve(request)},
            rounds,
            warmup_rounds=1,
        )
    return {
        f"{mode}_mode_us": round(statistics.median(samples) / (batch * steps) * 1e6, 2)
        for mode, samples in times.items()
    }


def run(
    batches: tuple[int, ...] = (1, 8, 32),
    steps: int = 50,
    guidance: float = 4.0,
    rounds: int = 7,
) -> dict[str, Any]:
    """µs per request-step at each B, in step mode and request mode, as a JSON-able dict."""
    return {
        "benchmark": "step_overhead",
        "pipeline": "digits with a network that returns zeros (FreeDenoiser)",
        "steps": steps,
        "guidance_scale": guidance,
        "torch_threads": torch.get_num_threads(),
        "us_per_request_step": {
            str(batch): measure(batch, steps, guidance, rounds) for batch in batches
        },
    }
