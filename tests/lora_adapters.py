"""Random low-rank adapters for the digits network, and a fault for the mp tests.

Workers import the fault by this module's name (the tests' folder is on their
path), so it lives here rather than in a test module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffusion_runtime import LoRARequest
from diffusion_runtime.pipelines.digits.model import DenoiserConfig, DigitDenoiser
from diffusion_runtime.testing.adapter_files import linear_shapes, write_random_adapter


def digits_layer_shapes() -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every linear layer of the digits network, by name."""
    return linear_shapes(DigitDenoiser(DenoiserConfig()))


def write_adapter(
    path: Path,
    seed: int,
    rank: int = 4,
    layers: list[str] | None = None,
    alpha: float | None = None,
) -> Path:
    """A random adapter of ``rank`` on ``layers`` (default: all) of the digits network."""
    return write_random_adapter(path, digits_layer_shapes(), seed, rank, layers, alpha)


def write_peft_adapter(
    pipe: Any, directory: Path, targets: list[str], rank: int, alpha: float, seed: int
) -> Path:
    """A random LoRA on ``targets`` of a diffusers ``pipe``'s UNet (which it changes),
    written as diffusers writes one; needs peft."""
    from peft import LoraConfig, get_peft_model_state_dict

    unet = pipe.unet
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    unet.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in unet.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    type(pipe).save_lora_weights(
        directory,
        unet_lora_layers=get_peft_model_state_dict(unet),
        weight_name="adapter.safetensors",
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
    )
    return directory / "adapter.safetensors"


def adapter(directory: Path, adapter_id: int, scale: float = 1.0, rank: int = 4) -> LoRARequest:
    """A :class:`LoRARequest` for a random adapter written under ``directory``."""
    path = directory / f"adapter-{adapter_id}.safetensors"
    if not path.exists():
        write_adapter(path, seed=adapter_id, rank=rank)
    return LoRARequest(f"adapter-{adapter_id}", adapter_id, str(path), scale)


#: An adapter whose name contains this fails to stage on rank 1 (see FailStageOnRankOne).
FAULTY_NAME = "fails-on-rank-1"


class FailStageOnRankOne:
    """A worker extension that injects a fault: on rank 1, staging an adapter
    named with :data:`FAULTY_NAME` raises after rank 0 staged it."""

    def __init__(self, worker: Any) -> None:
        if worker.rank != 1:
            return
        stage = worker._methods["stage_lora"]

        def failing_stage(request: LoRARequest) -> None:
            if FAULTY_NAME in request.name:
                raise OSError("disk error on rank 1")
            stage(request)

        worker._methods["stage_lora"] = failing_stage
