"""``DiffusersPipeline``: a diffusers pipeline object run in request mode and step mode."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.diffusers.family import Encoded, Family
from diffusion_runtime.pipelines.diffusers.scheduler_steps import seed_noise_sampler
from diffusion_runtime.pipelines.diffusers.support import family_for
from diffusion_runtime.pipelines.protocols import (
    PipelineRequest,
    Prompt,
    StepRequestState,
    forward_by_steps,
)
from diffusion_runtime.sampling_params import SamplingParams

_OWNER = "DiffusersPipeline"


class DiffusersPipeline:
    """Runs a supported diffusers pipeline inside the runtime, in request and step mode.

    The pipeline's denoising loop is split at step boundaries: ``prepare_encode``
    encodes the prompt, draws the initial latents from the request's own
    generator and gives the request its own copy of the pipeline's scheduler
    (diffusers schedulers are stateful); ``denoise_step`` calls the denoiser
    once for the stacked rows of every running request, whatever their step
    index, and applies classifier-free guidance per request;
    ``step_scheduler`` advances one request; ``post_decode`` decodes it.
    ``forward`` runs those same methods, so both modes give identical images.

    ``rows_per_call=None`` calls the denoiser once per step on all rows: a
    request that runs alone gets exactly diffusers' output, but CPU GEMM
    kernels depend on the row count, so batch mates move its pixels by
    rounding (about 1e-6). ``rows_per_call=R`` calls it on padded chunks of
    exactly ``R`` rows, so a request's images are bit-identical whatever it
    is batched with, and differ from diffusers' own output by that rounding.

    The pipeline object is moved to ``device``. See :data:`SUPPORTED_PIPELINES`.
    """

    supports_request_batch = True

    def __init__(
        self,
        pipe: Any,
        device: torch.device | str = "cpu",
        *,
        rows_per_call: int | None = None,
    ) -> None:
        family_cls = family_for(pipe)
        if rows_per_call is not None and (
            isinstance(rows_per_call, bool)
            or not isinstance(rows_per_call, int)
            or rows_per_call < 1
        ):
            raise InvalidFieldError(
                _OWNER, "rows_per_call", "must be a positive int or None", rows_per_call
            )
        self.device = torch.device(device)
        self.rows_per_call = rows_per_call
        self._family: Family | None = family_cls(pipe.to(self.device), self.device)
        self._scheduler_template = copy.deepcopy(pipe.scheduler)

    @property
    def family(self) -> Family:
        """The pipeline-specific half; raises once the pipeline is closed."""
        if self._family is None:
            raise RuntimeError(f"{_OWNER} is closed")
        return self._family

    # -- request mode ------------------------------------------------------------------

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """Reject, naming the field, what the wrapped pipeline cannot serve."""
        self.family.validate(prompt, params)

    def warmup_request(self) -> tuple[Prompt, SamplingParams]:
        """A request of the fewest steps the scheduler runs, through the whole path."""
        family = self.family
        params = SamplingParams(num_inference_steps=family.min_inference_steps, seed=0)
        return family.warmup_prompt(), params

    @torch.no_grad()
    def forward(self, batch: Sequence[PipelineRequest]) -> dict[str, torch.Tensor]:
        """Sample every request of ``batch`` together; images keyed by request id."""
        return forward_by_steps(self, batch)

    # -- step mode ---------------------------------------------------------------------

    @torch.no_grad()
    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        """Encode the prompt, draw the initial latents and set up the request's own scheduler."""
        family, params = self.family, request.params
        family.validate(request.prompt, params)
        scheduler = copy.deepcopy(self._scheduler_template)
        device = self.device if family.timesteps_on_device else None
        scheduler.set_timesteps(params.num_inference_steps, device=device)
        latents, encoded = family.encode(request, scheduler, family.image_size(params))
        seed_noise_sampler(scheduler, request.generator)  # after the latents, as diffusers draws
        return StepRequestState(
            request=request,
            latents=latents,
            timesteps=list(scheduler.timesteps),
            scheduler=scheduler,
            conditioning=encoded,
        )

    @torch.no_grad()
    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """One denoiser call over all states' rows; each state's guided model output."""
        family = self.family
        inputs: list[torch.Tensor] = []
        times: list[torch.Tensor] = []
        for state in states:
            encoded: Encoded = state.conditioning
            t = state.timesteps[state.step_index]
            x = state.latents
            if encoded.guidance is not None:
                x = torch.cat([x, x])
            if family.scales_model_input:
                x = state.scheduler.scale_model_input(x, t)
            inputs.append(x)
            times.append(torch.as_tensor(t, device=self.device).reshape(1).expand(len(x)))
        output = self._run_denoiser(torch.cat(inputs), torch.cat(times), _stacked_rows(states))
        parts = torch.split(output, [len(x) for x in inputs])
        return [
            family.combine(part, state.conditioning.guidance)
            for state, part in zip(states, parts, strict=True)
        ]

    @torch.no_grad()
    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None:
        """Advance one request by one step of its own scheduler."""
        encoded: Encoded = state.conditioning
        t = state.timesteps[state.step_index]
        result = state.scheduler.step(model_output, t, state.latents, **encoded.step_kwargs)
        state.latents = result.prev_sample
        encoded.x0 = getattr(result, "pred_original_sample", None)
        state.step_index += 1

    @torch.no_grad()
    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        """The finished images, ``(N, C, H, W)`` in ``[0, 1]``."""
        return self.family.decode(state.latents, state.request.generator)

    @torch.no_grad()
    def preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The decoded clean-image estimate, when the scheduler reports one."""
        x0: torch.Tensor | None = state.conditioning.x0
        return None if x0 is None else self.family.decode(x0, None)

    def close(self) -> None:
        """Drop the pipeline."""
        self._family = None

    def _run_denoiser(
        self, x: torch.Tensor, t: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        family, size = self.family, self.rows_per_call
        if size is None:
            output: torch.Tensor = family.run_denoiser(x, t, rows)
            return output
        count = len(x)
        x, t = _pad_rows(x, size), _pad_rows(t, size)
        rows = None if rows is None else _pad_rows(rows, size)
        chunks = [
            family.run_denoiser(
                x[i : i + size], t[i : i + size], None if rows is None else rows[i : i + size]
            )
            for i in range(0, len(x), size)
        ]
        return torch.cat(chunks)[:count]


def _stacked_rows(states: Sequence[StepRequestState]) -> torch.Tensor | None:
    """All states' conditioning rows as one tensor, cached on an unchanged InputBatch."""
    cache: dict[str, Any] | None = getattr(states, "cache", None)
    if cache is not None and "rows" in cache:
        cached: torch.Tensor | None = cache["rows"]
        return cached
    parts = [state.conditioning.rows for state in states]
    rows = None if any(part is None for part in parts) else torch.cat(parts)
    if cache is not None:
        cache["rows"] = rows
    return rows


def _pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """``tensor`` with its last row repeated up to a multiple of ``multiple`` rows."""
    pad = -len(tensor) % multiple
    if not pad:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(pad, *tensor.shape[1:])])
