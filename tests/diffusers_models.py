"""Tiny random-weight diffusers pipelines built from config: no download, ~0.1 s each.

Every builder seeds torch before creating the modules, so two calls give the
same weights. Sizes are the smallest that keep every code path of the real
pipelines (attention, cross-attention, VAE, classifier-free guidance) alive.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import torch

WEIGHT_SEED = 0


def _seeded() -> None:
    torch.manual_seed(WEIGHT_SEED)


def tiny_unet2d() -> Any:
    from diffusers import UNet2DModel

    _seeded()
    return UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
    ).eval()


def tiny_vae() -> Any:
    from diffusers import AutoencoderKL

    _seeded()
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    ).eval()


def quiet(pipe: Any) -> Any:
    """``pipe`` without its progress bar."""
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ddim_pipeline() -> Any:
    from diffusers import DDIMPipeline, DDIMScheduler

    scheduler = DDIMScheduler(num_train_timesteps=1000)
    return quiet(DDIMPipeline(unet=tiny_unet2d(), scheduler=scheduler))


def ddpm_pipeline() -> Any:
    from diffusers import DDPMPipeline, DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000)
    return quiet(DDPMPipeline(unet=tiny_unet2d(), scheduler=scheduler))


def dit_pipeline() -> Any:
    """A DiT over 8x8x4 latents (16 tokens of patch 2), 1000 classes plus the null class."""
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    _seeded()
    transformer = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        norm_num_groups=4,
    ).eval()
    pipe = DiTPipeline(
        transformer=transformer,
        vae=tiny_vae(),
        scheduler=DDIMScheduler(num_train_timesteps=1000),
        id2label={0: "tench, Tinca tinca", 1: "goldfish"},
    )
    return quiet(pipe)


def with_scheduler(pipe: Any, name: str, **config: Any) -> Any:
    """A pipeline sharing ``pipe``'s modules, with the diffusers scheduler class ``name``."""
    import diffusers

    scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config, **config)
    extra = {"requires_safety_checker": False} if "safety_checker" in pipe.components else {}
    return quiet(type(pipe)(**{**pipe.components, "scheduler": scheduler}, **extra))


def tiny_tokenizer(directory: Path) -> Any:
    """A CLIP tokenizer over single letters and digits, from files written to ``directory``."""
    from transformers import CLIPTokenizer

    symbols = string.ascii_lowercase + string.digits
    tokens = ["<|startoftext|>", "<|endoftext|>", "!"]
    tokens += list(symbols) + [f"{s}</w>" for s in symbols]
    vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    merges_file.write_text("#version: 0.2\n")
    return CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=16)


def stable_diffusion_pipeline(tokenizer_dir: Path, **unet_config: Any) -> Any:
    """A StableDiffusionPipeline over 8x8x4 latents (16x16 images), no safety checker."""
    from diffusers import (
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    _seeded()
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        **unet_config,
    ).eval()
    _seeded()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_hidden_layers=2,
            vocab_size=128,
            max_position_embeddings=16,
        )
    ).eval()
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=text_encoder,
        tokenizer=tiny_tokenizer(tokenizer_dir),
        unet=unet,
        scheduler=DDIMScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return quiet(pipe)
