"""A tiny random-weight DiT built from config (nothing downloaded), for benchmarks
and the harness targets that run the DiT family."""

from __future__ import annotations

import importlib
from typing import Any

import torch


def tiny_dit(latent_size: int = 16, seed: int = 0, num_layers: int = 2) -> Any:
    """A random-weight ``DiTPipeline``: 2 layers (by default), 2 heads of 16, patch 2,
    a 2-block VAE."""
    diffusers = importlib.import_module("diffusers")
    torch.manual_seed(seed)
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=num_layers,
        sample_size=latent_size,
        patch_size=2,
        norm_num_groups=4,
    )
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=2 * latent_size,
    )
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=1000)
    pipe = diffusers.DiTPipeline(
        transformer=transformer.eval(), vae=vae.eval(), scheduler=scheduler
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
