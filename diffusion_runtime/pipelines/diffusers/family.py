"""What differs between the supported diffusers pipelines, behind one interface.

A :class:`Family` knows how one diffusers pipeline class encodes a request,
calls its denoiser, combines classifier-free guidance rows and decodes
latents, written to repeat that pipeline's own ``__call__`` operation for
operation so that the adapter's output equals diffusers'. Nothing here imports
diffusers: a family only touches the pipeline object it is given.
"""

from __future__ import annotations

import abc
import inspect
import math
from typing import Any, ClassVar, NoReturn

import attrs
import torch

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.diffusers.dit_blocks import DiTBlocks
from diffusion_runtime.pipelines.diffusers.scheduler_steps import minimum_inference_steps
from diffusion_runtime.pipelines.parallel import SequenceContext
from diffusion_runtime.pipelines.protocols import PipelineRequest, Prompt
from diffusion_runtime.sampling_params import SamplingParams


@attrs.define(eq=False)
class Encoded:
    """What ``prepare_encode`` computed once for a request (``StepRequestState.conditioning``).

    ``rows`` is the denoiser's conditioning, one row per denoiser input row
    (``2 * N`` rows under guidance, in the pipeline's own order) or ``None``
    for an unconditional model. ``guidance`` is the guidance scale when
    classifier-free guidance is on, else ``None``. ``x0`` is the scheduler's
    latest estimate of the clean latents, kept for previews.
    """

    rows: torch.Tensor | None
    guidance: float | None
    step_kwargs: dict[str, Any]
    x0: torch.Tensor | None = None


class Family(abc.ABC):
    """The pipeline-specific half of the adapter, for one diffusers pipeline class."""

    #: The diffusers pipeline class names this family runs.
    pipeline_classes: ClassVar[tuple[str, ...]]
    #: Whether the pipeline calls ``scheduler.scale_model_input`` before the denoiser.
    scales_model_input: ClassVar[bool] = True
    #: Whether the pipeline puts the scheduler's timesteps on the execution device.
    timesteps_on_device: ClassVar[bool] = False
    #: Whether ``extra_args={"eta": ...}`` is accepted (passed to ``scheduler.step``).
    accepts_eta: bool = False
    #: Whether the pipeline's loop applies ``init_noise_sigma`` to the initial noise. Those
    #: that do not (DDPM, DiT) give a sigma-scaled scheduler (Euler, Heun...) wrong inputs.
    applies_noise_sigma: ClassVar[bool] = True
    #: Whether ``decode`` treats each row on its own and ignores the generator, so that
    #: requests finishing together can be decoded by one call.
    decodes_rows_alone: ClassVar[bool] = True
    #: Whether guidance above 1 stacks two branches whose rows ranks can split
    #: (``cfg_parallel_size``, ``docs/parallelism.md``).
    takes_guidance: ClassVar[bool] = False
    #: Whether ranks can split each row's tokens (``ulysses_degree``, ``ring_degree``):
    #: such a family implements :meth:`enable_sequence`.
    splits_sequence: ClassVar[bool] = False
    #: The step caches this family serves (``docs/caching.md``).
    cache_backends: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def refusal(cls, pipe: Any) -> str | None:
        """Why this family cannot run ``pipe`` faithfully, or ``None`` when it can."""
        scheduler = pipe.scheduler
        if not cls.applies_noise_sigma and float(scheduler.init_noise_sigma) != 1.0:
            return (
                f"its {type(scheduler).__name__} scales the noise (init_noise_sigma != 1), but "
                f"{type(pipe).__name__} never scales the initial noise, so its output with "
                "such a scheduler is not that scheduler's result; the adapter refuses rather "
                "than copy or silently fix that"
            )
        return None

    def __init__(self, pipe: Any, device: torch.device) -> None:
        self.pipe = pipe
        self.device = device
        self.owner = type(pipe).__name__
        #: The fewest steps the pipeline's scheduler runs (4 for PNDM's Runge-Kutta warm-up).
        self.min_inference_steps = minimum_inference_steps(pipe.scheduler)

    @property
    @abc.abstractmethod
    def native_size(self) -> tuple[int, int]:
        """``(height, width)`` of the images when a request leaves them unset."""

    @abc.abstractmethod
    def check_prompt(self, prompt: Prompt) -> None:
        """Raise :class:`InvalidFieldError` for a prompt this pipeline cannot take."""

    @abc.abstractmethod
    def warmup_prompt(self) -> Prompt:
        """A valid prompt for the start-up request."""

    @abc.abstractmethod
    def encode(
        self, request: PipelineRequest, scheduler: Any, size: tuple[int, int]
    ) -> tuple[torch.Tensor, Encoded]:
        """The initial latents (drawn from ``request.generator``) and the encoded conditioning."""

    @abc.abstractmethod
    def run_denoiser(self, x: torch.Tensor, t: torch.Tensor, rows: torch.Tensor | None) -> Any:
        """The denoiser's raw output for stacked inputs ``x`` at per-row timesteps ``t``."""

    def no_output(self, x: torch.Tensor) -> torch.Tensor:
        """The denoiser's output for none of the rows of ``x``: ``(0, out_channels, h, w)``."""
        denoiser = getattr(self.pipe, "transformer", None) or self.pipe.unet
        return x.new_empty((0, int(denoiser.config.out_channels), *x.shape[2:]))

    def enable_sequence(self, context: SequenceContext) -> None:
        """Split each denoiser call's tokens over ``context``'s ranks (families that
        declare :attr:`splits_sequence`)."""
        raise NotImplementedError(f"{type(self).__name__} does not split sequences")

    def blocks(self) -> DiTBlocks | None:
        """The denoiser cut at its first block, for the first-block cache (``None``: not cut)."""
        return None

    @abc.abstractmethod
    def combine(self, output: torch.Tensor, guidance: float | None) -> torch.Tensor:
        """One request's model output for ``scheduler.step`` from its denoiser output rows."""

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Finished latents as ``(N, C, H, W)`` images in ``[0, 1]``."""

    # -- validation shared by the families ---------------------------------------------

    def validate(self, prompt: Prompt, params: SamplingParams) -> None:
        """Raise :class:`InvalidFieldError` naming the first field this pipeline cannot serve."""
        self.check_prompt(prompt)
        if params.custom_schedule is None:
            self._check_step_count(params)
        self.image_size(params)
        self.eta(params)

    def _check_step_count(self, params: SamplingParams) -> None:
        """``num_inference_steps`` within what the scheduler runs (a custom schedule is
        checked against the scheduler itself, see :mod:`.schedules`)."""
        if params.num_inference_steps < self.min_inference_steps:
            rule = (
                f"must be at least {self.min_inference_steps} "
                f"(the fewest steps {type(self.pipe.scheduler).__name__} runs)"
            )
            self.fail("num_inference_steps", rule, params.num_inference_steps)
        train_steps = getattr(self.pipe.scheduler.config, "num_train_timesteps", None)
        if train_steps is not None and params.num_inference_steps > train_steps:
            rule = f"must be at most {train_steps} (the scheduler's training timesteps)"
            self.fail("num_inference_steps", rule, params.num_inference_steps)

    def image_size(self, params: SamplingParams) -> tuple[int, int]:
        """The requested ``(height, width)``: only the native size unless a family allows more."""
        native = self.native_size
        for field, value, side in (
            ("height", params.height, native[0]),
            ("width", params.width, native[1]),
        ):
            if value is not None and value != side:
                self.fail(field, f"must be {side} (this pipeline's fixed size) or None", value)
        return native

    def eta(self, params: SamplingParams) -> float:
        """The DDIM ``eta`` from ``extra_args`` (0 when unset); refuses any other extra arg."""
        allowed = {"eta"} if self.accepts_eta else set()
        unknown = sorted(set(params.extra_args) - allowed)
        if unknown:
            rule = "accepts only " + (", ".join(sorted(allowed)) or "no keys")
            self.fail("extra_args", rule, unknown)
        value = params.extra_args.get("eta", 0.0)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and 0.0 <= value <= 1.0)
        ):
            self.fail("extra_args['eta']", "must be a number in [0, 1]", value)
        return float(value)

    def fail(self, field: str, rule: str, value: object) -> NoReturn:
        raise InvalidFieldError(self.owner, field, rule, value)


def draw_latents(
    shape: tuple[int, ...],
    generator: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Initial noise drawn exactly as diffusers' ``randn_tensor`` draws it with one generator.

    One ``torch.randn`` call for the whole ``(N, C, h, w)`` shape (so ``N``
    images from one generator are one draw, not ``N``), on the generator's
    device (a CPU generator draws on the CPU and the noise is then moved), in
    the model's dtype.
    """
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    return noise.to(device)


def step_kwargs(scheduler: Any, **candidates: Any) -> dict[str, Any]:
    """The subset of ``candidates`` that ``scheduler.step`` accepts (as diffusers passes them)."""
    accepted = inspect.signature(scheduler.step).parameters
    return {name: value for name, value in candidates.items() if name in accepted}
