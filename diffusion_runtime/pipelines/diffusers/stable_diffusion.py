"""``StableDiffusionPipeline``: text-to-image latent sampling with a ``UNet2DConditionModel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from diffusion_runtime.pipelines.diffusers.family import Encoded, Family, draw_latents, step_kwargs
from diffusion_runtime.pipelines.protocols import PipelineRequest, Prompt
from diffusion_runtime.sampling_params import SamplingParams

_PROMPT_KEYS = frozenset({"prompt", "negative_prompt"})


class StableDiffusionFamily(Family):
    """Text-to-image sampling, as ``StableDiffusionPipeline.__call__``.

    A prompt is a ``str``, or ``{"prompt": str, "negative_prompt": str}``.
    The text is encoded by the pipeline's own ``encode_prompt`` (so
    ``num_outputs_per_prompt`` is its ``num_images_per_prompt``); guidance
    above 1 stacks ``[negative] * N + [prompt] * N`` rows. Height and width
    are any multiples of 8; ``extra_args={"eta": ...}`` is the pipeline's
    ``eta``. Decoding runs the pipeline's safety checker when it has one.
    """

    pipeline_classes = ("StableDiffusionPipeline",)
    timesteps_on_device = True
    decodes_rows_alone = False  # the VAE takes the request's generator; the safety checker runs
    accepts_eta = True
    takes_guidance = True

    @classmethod
    def refusal(cls, pipe: Any) -> str | None:
        config = pipe.unet.config
        if config.time_cond_proj_dim is not None:
            return "its UNet embeds the guidance scale (time_cond_proj_dim), which is not supported"
        if config.addition_embed_type is not None:
            return "its UNet needs added conditioning (addition_embed_type), which is not supported"
        return None

    @property
    def native_size(self) -> tuple[int, int]:
        size = self.pipe.unet.config.sample_size
        height, width = (size, size) if isinstance(size, int) else (size[0], size[1])
        scale = self.pipe.vae_scale_factor
        return int(height) * scale, int(width) * scale

    def texts(self, prompt: Prompt) -> tuple[str, str | None]:
        """``(prompt, negative_prompt)`` from a prompt."""
        if isinstance(prompt, str):
            return prompt, None
        if (
            isinstance(prompt, Mapping)
            and isinstance(prompt.get("prompt"), str)
            and set(prompt) <= _PROMPT_KEYS
            and isinstance(prompt.get("negative_prompt", ""), str)
        ):
            return prompt["prompt"], prompt.get("negative_prompt")
        rule = "must be a str or a dict with a str 'prompt' and an optional str 'negative_prompt'"
        self.fail("prompt", rule, prompt)

    def check_prompt(self, prompt: Prompt) -> None:
        self.texts(prompt)

    def image_size(self, params: SamplingParams) -> tuple[int, int]:
        native = self.native_size
        height = native[0] if params.height is None else params.height
        width = native[1] if params.width is None else params.width
        for field, value in (("height", height), ("width", width)):
            if value % 8:
                self.fail(field, "must be a multiple of 8", value)
        return height, width

    def warmup_prompt(self) -> Prompt:
        return ""

    def encode(
        self, request: PipelineRequest, scheduler: Any, size: tuple[int, int]
    ) -> tuple[torch.Tensor, Encoded]:
        pipe, params = self.pipe, request.params
        text, negative = self.texts(request.prompt)
        count = params.num_outputs_per_prompt
        guided = params.guidance_scale > 1
        embeds, negative_embeds = pipe.encode_prompt(
            text, self.device, count, guided, negative_prompt=negative
        )
        rows = torch.cat([negative_embeds, embeds]) if guided else embeds
        scale = pipe.vae_scale_factor
        shape = (count, pipe.unet.config.in_channels, size[0] // scale, size[1] // scale)
        noise = draw_latents(shape, request.generator, self.device, embeds.dtype)
        latents = noise * scheduler.init_noise_sigma
        kwargs = step_kwargs(scheduler, eta=self.eta(params), generator=request.generator)
        guidance = params.guidance_scale if guided else None
        return latents, Encoded(rows=rows, guidance=guidance, step_kwargs=kwargs)

    def run_denoiser(self, x: torch.Tensor, t: torch.Tensor, rows: torch.Tensor | None) -> Any:
        return self.pipe.unet(x, t, encoder_hidden_states=rows, return_dict=False)[0]

    def combine(self, output: torch.Tensor, guidance: float | None) -> torch.Tensor:
        if guidance is None:
            return output
        uncond, text = output.chunk(2)
        return uncond + guidance * (text - uncond)

    def decode(self, latents: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        pipe = self.pipe
        scaled = latents / pipe.vae.config.scaling_factor
        image = pipe.vae.decode(scaled, return_dict=False, generator=generator)[0]
        image, nsfw = pipe.run_safety_checker(image, self.device, latents.dtype)
        denormalize = [True] * len(image) if nsfw is None else [not flag for flag in nsfw]
        images: torch.Tensor = pipe.image_processor.postprocess(
            image, output_type="pt", do_denormalize=denormalize
        )
        return images
