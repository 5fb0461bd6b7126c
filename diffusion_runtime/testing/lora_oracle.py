"""The direct oracle for requests with a LoRA adapter: the adapter merged into a
copy of the network's weights, ``W + scale * (alpha / rank) * B @ A``.

It reads the adapter file itself and runs a pipeline with no adapter slots,
so nothing of the runtime's adapter path (the table, the workers' stores,
the device slots, the batched layers, each row's slot and scale) is on its
side of the comparison. Merging changes the order of the float sums, so its
images match the engine's within :data:`MERGED_TOLERANCE`, not bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.pipelines.registry import build_pipeline
from diffusion_runtime.runner.worker import worker_device
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.testing.oracle import DirectOracle

#: The largest difference allowed between the engine's images and the merged
#: network's. Measured over 300 digits requests with 2-6 DDIM steps, guidance
#: up to 2: at most 1.2e-3 (a single step, which predicts the image from pure
#: noise, amplifies it to 1.2e-2). Another adapter, scale or batch mate's
#: adapter moves pixels by 0.1 or more.
MERGED_TOLERANCE = 1e-2


class MergedAdapterOracle(DirectOracle):
    """A :class:`DirectOracle` that runs a request with an adapter on a pipeline
    whose network has that adapter merged in (one pipeline per adapter and scale,
    built on first use). The pipeline must expose its network as ``model``."""

    def __init__(self, config: EngineConfig) -> None:
        base = DirectOracle.for_config(config)
        super().__init__(base.pipeline, base.device, step_mode=base.step_mode)
        self.config = config
        self._merged: dict[tuple[str, float], DirectOracle] = {}

    def images(self, prompt: Any, params: SamplingParams, seed: int) -> torch.Tensor | None:
        if params.lora is None:
            return super().images(prompt, params, seed)
        return self._oracle_for(params.lora).images(prompt, params, seed)

    def _oracle_for(self, lora: LoRARequest) -> DirectOracle:
        key = (lora.path, lora.scale)
        oracle = self._merged.get(key)
        if oracle is None:
            config = self.config
            device = worker_device(config, 0)
            pipeline = build_pipeline(config.pipeline, device, config.pipeline_kwargs)
            merge_adapter(pipeline.model, lora)
            oracle = self._merged[key] = DirectOracle(pipeline, device, step_mode=self.step_mode)
        return oracle


def merge_adapter(model: nn.Module, lora: LoRARequest) -> None:
    """Add ``lora``'s update, at its scale, to the weights of ``model``'s linear layers."""
    with safe_open(lora.path, framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (no __iter__)
        alpha = (handle.metadata() or {}).get("alpha")
    with torch.no_grad():
        for name, module in model.named_modules():
            a = tensors.get(f"{name}.lora_A")
            if not isinstance(module, nn.Linear) or a is None:
                continue
            b = tensors[f"{name}.lora_B"]
            rank = a.shape[0]
            factor = lora.scale * (rank if alpha is None else float(alpha)) / rank
            module.weight += factor * (b @ a).to(module.weight)
