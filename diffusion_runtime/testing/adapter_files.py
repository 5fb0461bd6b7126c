"""Random low-rank adapter files for a network, for tests and harnesses."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from diffusion_runtime.lora.weights import LayerShapes, save_adapter


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every linear layer of ``model``, by name."""
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }


def write_random_adapter(
    path: Path,
    shapes: LayerShapes,
    seed: int,
    rank: int = 4,
    layers: Collection[str] | None = None,
    alpha: float | None = None,
) -> Path:
    """A random adapter of ``rank`` (entries of size about 0.05) on ``layers``
    (default: all of ``shapes``), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    pairs = {
        name: (
            torch.randn(rank, fan_in, generator=generator) * 0.05,
            torch.randn(fan_out, rank, generator=generator) * 0.05,
        )
        for name, (fan_in, fan_out) in shapes.items()
        if layers is None or name in layers
    }
    save_adapter(path, pairs, alpha=alpha)
    return path
