"""``DDIMPipeline`` and ``DDPMPipeline``: unconditional pixel sampling with a ``UNet2DModel``."""

from __future__ import annotations

from typing import Any

import torch

from diffusion_runtime.pipelines.diffusers.family import Encoded, Family, draw_latents, step_kwargs
from diffusion_runtime.pipelines.protocols import PipelineRequest, Prompt
from diffusion_runtime.sampling_params import SamplingParams


class UnconditionalFamily(Family):
    """Unconditional UNet sampling, as ``DDIMPipeline.__call__`` / ``DDPMPipeline.__call__``.

    There is nothing to condition on: the prompt must be ``None`` or ``""`` and
    the guidance scale at most 1. ``num_outputs_per_prompt`` is diffusers'
    ``batch_size``; the size is the UNet's ``sample_size``. ``DDIMPipeline``
    takes ``extra_args={"eta": ...}`` like its ``eta`` argument.
    """

    pipeline_classes = ("DDIMPipeline", "DDPMPipeline")
    scales_model_input = False  # neither pipeline calls scale_model_input
    applies_noise_sigma = False

    def __init__(self, pipe: Any, device: torch.device) -> None:
        super().__init__(pipe, device)
        self.is_ddim = self.accepts_eta = self.owner == "DDIMPipeline"

    @property
    def native_size(self) -> tuple[int, int]:
        size = self.pipe.unet.config.sample_size
        return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))

    def check_prompt(self, prompt: Prompt) -> None:
        if prompt not in (None, ""):
            self.fail(
                "prompt", "must be None or '' (an unconditional model takes no prompt)", prompt
            )

    def validate(self, prompt: Prompt, params: SamplingParams) -> None:
        super().validate(prompt, params)
        if params.guidance_scale > 1.0:
            rule = "must be at most 1 (an unconditional model has no guidance)"
            self.fail("guidance_scale", rule, params.guidance_scale)

    def warmup_prompt(self) -> Prompt:
        return ""

    def encode(
        self, request: PipelineRequest, scheduler: Any, size: tuple[int, int]
    ) -> tuple[torch.Tensor, Encoded]:
        unet = self.pipe.unet
        shape = (request.params.num_outputs_per_prompt, unet.config.in_channels, *size)
        latents = draw_latents(shape, request.generator, self.device, unet.dtype)
        generator = request.generator
        if self.is_ddim:
            kwargs = step_kwargs(
                scheduler,
                eta=self.eta(request.params),
                use_clipped_model_output=None,
                generator=generator,
            )
        else:
            kwargs = step_kwargs(scheduler, generator=generator)
        return latents, Encoded(rows=None, guidance=None, step_kwargs=kwargs)

    def run_denoiser(self, x: torch.Tensor, t: torch.Tensor, rows: torch.Tensor | None) -> Any:
        return self.pipe.unet(x, t).sample

    def combine(self, output: torch.Tensor, guidance: float | None) -> torch.Tensor:
        return output

    def decode(self, latents: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return (latents / 2 + 0.5).clamp(0, 1)
