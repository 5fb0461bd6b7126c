"""``DiTPipeline``: class-conditional latent sampling with a ``DiTTransformer2DModel``."""

from __future__ import annotations

from typing import Any

import torch

from diffusion_runtime.pipelines.diffusers.dit_blocks import DiTBlocks
from diffusion_runtime.pipelines.diffusers.family import Encoded, Family, draw_latents, step_kwargs
from diffusion_runtime.pipelines.diffusers.sequence_parallel import (
    SequenceParallelDiT,
    check_sequence_split,
)
from diffusion_runtime.pipelines.parallel import SequenceContext
from diffusion_runtime.pipelines.protocols import PipelineRequest, Prompt


class DiTFamily(Family):
    """Class-label sampling, as ``DiTPipeline.__call__``.

    A prompt is a class id (``int``, or its decimal string as the CLI passes
    it) or one of the pipeline's label names (``pipe.labels``, from its
    ``id2label``; a label wins over a class id). ``num_outputs_per_prompt`` = N is
    diffusers' ``class_labels=[label] * N``. Guidance above 1 stacks the
    request's rows as ``[label] * N + [null] * N`` and guides the noise
    channels only, as diffusers does; with a learned-variance transformer
    only the noise channels reach the scheduler. The scheduler gets the
    request's generator when its ``step`` takes one (diffusers passes none, so
    a stochastic scheduler there draws from the global RNG).
    """

    pipeline_classes = ("DiTPipeline",)
    applies_noise_sigma = False
    takes_guidance = True
    splits_sequence = True
    cache_backends = frozenset({"tea_cache", "first_block"})

    @classmethod
    def refusal(cls, pipe: Any) -> str | None:
        config = pipe.transformer.config
        if config.out_channels not in (config.in_channels, 2 * config.in_channels):
            return "its transformer's out_channels is neither in_channels nor twice that"
        return super().refusal(pipe)

    def __init__(self, pipe: Any, device: torch.device) -> None:
        super().__init__(pipe, device)
        config = pipe.transformer.config
        self.num_classes = int(config.num_embeds_ada_norm)
        self.null_class = 1000  # DiTPipeline's fixed "no class" label
        self.channels = int(config.in_channels)
        self.learned_sigma = config.out_channels // 2 == self.channels
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        self.latent_size = int(config.sample_size)
        self.image_side = self.latent_size * vae_scale
        self._sequence: SequenceParallelDiT | None = None

    @property
    def native_size(self) -> tuple[int, int]:
        return self.image_side, self.image_side

    def label(self, prompt: Prompt) -> int:
        """The class id a prompt names."""
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            if 0 <= prompt < self.num_classes:
                return prompt
        elif isinstance(prompt, str):
            name = prompt.strip()
            if name in self.pipe.labels:
                return int(self.pipe.labels[name])
            if name.isdecimal() and int(name) < self.num_classes:  # a class id from the CLI
                return int(name)
        rule = (
            f"must be a class id in [0, {self.num_classes}) (an int or its decimal string) "
            "or a label of pipe.labels"
        )
        self.fail("prompt", rule, prompt)

    def check_prompt(self, prompt: Prompt) -> None:
        self.label(prompt)

    def warmup_prompt(self) -> Prompt:
        return 0

    def encode(
        self, request: PipelineRequest, scheduler: Any, size: tuple[int, int]
    ) -> tuple[torch.Tensor, Encoded]:
        params = request.params
        count = params.num_outputs_per_prompt
        shape = (count, self.channels, self.latent_size, self.latent_size)
        latents = draw_latents(shape, request.generator, self.device, self.pipe.transformer.dtype)
        labels = torch.full((count,), self.label(request.prompt), device=self.device)
        guidance = params.guidance_scale if params.guidance_scale > 1 else None
        if guidance is not None:
            labels = torch.cat([labels, torch.full_like(labels, self.null_class)])
        kwargs = step_kwargs(scheduler, generator=request.generator)
        return latents, Encoded(rows=labels, guidance=guidance, step_kwargs=kwargs)

    def enable_sequence(self, context: SequenceContext) -> None:
        check_sequence_split(self.pipe.transformer, context)
        self._sequence = SequenceParallelDiT(self.pipe.transformer, context)

    def run_denoiser(self, x: torch.Tensor, t: torch.Tensor, rows: torch.Tensor | None) -> Any:
        if self._sequence is not None:
            assert rows is not None, "a DiT row always has a class label"
            return self._sequence.forward(x, t, rows)
        return self.pipe.transformer(x, timestep=t, class_labels=rows).sample

    def blocks(self) -> DiTBlocks:
        return DiTBlocks(self.pipe.transformer)

    def combine(self, output: torch.Tensor, guidance: float | None) -> torch.Tensor:
        if guidance is not None:
            cond, uncond = torch.split(output[:, : self.channels], len(output) // 2)
            return uncond + guidance * (cond - uncond)
        return output[:, : self.channels] if self.learned_sigma else output

    def decode(self, latents: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        vae = self.pipe.vae
        samples: torch.Tensor = vae.decode(1 / vae.config.scaling_factor * latents).sample
        return (samples / 2 + 0.5).clamp(0, 1)
