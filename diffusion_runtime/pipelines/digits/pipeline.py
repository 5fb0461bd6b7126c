"""``DigitsPipeline``: class-conditional DDIM sampling of 8x8 handwritten digits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.digits.model import (
    IMAGE_SIZE,
    PIXELS,
    DDIMScheduler,
    DenoiserConfig,
    DigitDenoiser,
    cosine_alpha_bars,
    ddim_timesteps,
)
from diffusion_runtime.pipelines.protocols import (
    PipelineRequest,
    Prompt,
    StepRequestState,
    forward_by_steps,
)
from diffusion_runtime.sampling_params import SamplingParams

WEIGHTS_DIR = Path(__file__).parent
DENOISER_WEIGHTS = "denoiser.safetensors"
DENOISER_CONFIG = "denoiser.json"
MAX_GUIDANCE = 20.0
MAX_SIZE = 512
_DIGITS = "0123456789"
_OWNER = "DigitsPipeline"
# Rows per network call (see DigitDenoiser.predict_noise_row_stable): small on
# the CPU to keep single-request latency low, larger on accelerators.
_ROWS_PER_CALL = {"cpu": 32}
_ROWS_PER_CALL_DEFAULT = 256


def parse_digit(prompt: Prompt) -> int:
    """The digit a prompt asks for: an ``int`` 0-9 or a ``str`` "0"-"9" (whitespace stripped)."""
    if isinstance(prompt, int) and not isinstance(prompt, bool) and 0 <= prompt <= 9:
        return prompt
    if isinstance(prompt, str):
        text = prompt.strip()
        if len(text) == 1 and text in _DIGITS:
            return int(text)
    raise InvalidFieldError(_OWNER, "prompt", "must be a digit 0-9 (int or str)", prompt)


def output_size(params: SamplingParams) -> int:
    """The square output side for ``params`` (``None`` means the native 8)."""
    height = IMAGE_SIZE if params.height is None else params.height
    width = IMAGE_SIZE if params.width is None else params.width
    rule = f"must be a multiple of {IMAGE_SIZE} in [{IMAGE_SIZE}, {MAX_SIZE}]"
    for field, value in (("height", height), ("width", width)):
        if value % IMAGE_SIZE or not IMAGE_SIZE <= value <= MAX_SIZE:
            raise InvalidFieldError(_OWNER, field, rule, value)
    if height != width:
        raise InvalidFieldError(_OWNER, "width", "must equal height (square images only)", width)
    return height


class DigitsPipeline:
    """Class-conditional diffusion model of 8x8 digits (a residual MLP, ~1.3M parameters).

    Prompts are digits (``3`` or ``"3"``). Honours ``num_inference_steps``
    (DDIM, eta = 0), ``guidance_scale`` (classifier-free guidance when > 1),
    ``num_outputs_per_prompt`` and square ``height``/``width`` (nearest-neighbour
    upscaling). All randomness comes from each request's generator, and every
    request's images are bit-identical whatever it is batched with.
    """

    supports_request_batch = True

    def __init__(
        self, device: torch.device | str = "cpu", weights_dir: str | Path | None = None
    ) -> None:
        self.device = torch.device(device)
        root = WEIGHTS_DIR if weights_dir is None else Path(weights_dir)
        self.config = DenoiserConfig.load(root / DENOISER_CONFIG)
        model = DigitDenoiser(self.config)
        state = load_file(str(root / DENOISER_WEIGHTS))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        self._model: DigitDenoiser | None = model.to(self.device).eval().requires_grad_(False)
        self._alpha_bars = tuple(cosine_alpha_bars(self.config.num_train_timesteps).tolist())
        self._rows_per_call = _ROWS_PER_CALL.get(self.device.type, _ROWS_PER_CALL_DEFAULT)

    @property
    def model(self) -> DigitDenoiser:
        """The network; raises once the pipeline is closed."""
        if self._model is None:
            raise RuntimeError("DigitsPipeline is closed")
        return self._model

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """Reject what this pipeline cannot serve, naming the field."""
        parse_digit(prompt)
        steps = params.num_inference_steps
        if steps > self.config.num_train_timesteps:
            rule = f"must be at most {self.config.num_train_timesteps} (the training timesteps)"
            raise InvalidFieldError(_OWNER, "num_inference_steps", rule, steps)
        if params.guidance_scale > MAX_GUIDANCE:
            rule = f"must be at most {MAX_GUIDANCE}"
            raise InvalidFieldError(_OWNER, "guidance_scale", rule, params.guidance_scale)
        output_size(params)

    def warmup_request(self) -> tuple[Prompt, SamplingParams]:
        """A cheap request that exercises the whole sampling path."""
        return "0", SamplingParams(num_inference_steps=2, seed=0)

    def forward(self, batch: Sequence[PipelineRequest]) -> dict[str, torch.Tensor]:
        """Sample every request of ``batch`` as one fused batch; images keyed by request id."""
        return forward_by_steps(self, batch)

    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        """Draw the initial noise from the request's generator and set up its schedule."""
        digit = parse_digit(request.prompt)
        params = request.params
        count = params.num_outputs_per_prompt
        generator = request.generator
        noise = torch.randn(count, PIXELS, generator=generator, device=generator.device)
        timesteps = ddim_timesteps(params.num_inference_steps, self.config.num_train_timesteps)
        labels = torch.full((count,), digit, dtype=torch.long, device=self.device)
        return StepRequestState(
            request=request,
            latents=noise.to(self.device),
            timesteps=timesteps,
            scheduler=DDIMScheduler(self._alpha_bars, timesteps),
            conditioning=labels,
        )

    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """One network pass over all states (any step index); guided noise per state."""
        xs: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        timesteps: list[int] = []
        rows: list[int] = []
        for state in states:
            copies = 2 if _guided(state) else 1
            xs += [state.latents] * copies
            labels.append(state.conditioning)
            if copies == 2:
                labels.append(torch.full_like(state.conditioning, self.config.null_class))
            rows.append(copies * len(state.latents))
            timesteps += [state.timesteps[state.step_index]] * rows[-1]
        t = torch.tensor(timesteps, dtype=torch.long, device=self.device)
        eps = self.model.predict_noise_row_stable(
            torch.cat(xs), t, torch.cat(labels), self._rows_per_call
        )
        outputs = []
        for state, part in zip(states, torch.split(eps, rows), strict=True):
            if _guided(state):
                cond, uncond = part.chunk(2)
                part = torch.lerp(uncond, cond, state.request.params.guidance_scale)
            outputs.append(part)
        return outputs

    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None:
        """Advance one request by one DDIM step."""
        state.latents = state.scheduler.step(state.latents, model_output, state.step_index)
        state.step_index += 1

    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        """The finished images, ``(N, 1, H, W)`` in ``[0, 1]``."""
        return self._to_images(state.latents, output_size(state.request.params))

    def preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The current clean-image estimate, or ``None`` before the first step."""
        x0: torch.Tensor | None = state.scheduler.x0
        if x0 is None:
            return None
        return self._to_images(x0, output_size(state.request.params))

    def close(self) -> None:
        """Drop the network."""
        self._model = None

    @staticmethod
    def _to_images(x: torch.Tensor, size: int) -> torch.Tensor:
        images = ((x + 1) / 2).clamp(0.0, 1.0).reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE)
        scale = size // IMAGE_SIZE
        if scale > 1:
            images = images.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
        return images


def _guided(state: StepRequestState) -> bool:
    return state.request.params.guidance_scale > 1.0
