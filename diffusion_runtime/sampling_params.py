"""Per-request sampling parameters."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from diffusion_runtime.cache_settings import check_cache_dict
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.validation import (
    bounded_input,
    finite_in_range,
    int_in_range,
    is_bool,
    one_of,
    str_keyed_dict,
)

MAX_SEED = 2**63 - 1
#: ``priority`` lies in ``[-MAX_PRIORITY, MAX_PRIORITY]``.
MAX_PRIORITY = 2**31 - 1
#: ``deadline_s`` lies in ``[MIN_DEADLINE_S, MAX_DEADLINE_S]`` (1 ms to 30 days).
MIN_DEADLINE_S = 0.001
MAX_DEADLINE_S = 30 * 86_400.0
#: ``num_inference_steps`` lies in ``[1, MAX_STEPS]``; a custom schedule holds at most this many.
MAX_STEPS = 10_000
#: Each custom timestep or sigma lies in ``[0, MAX_SCHEDULE_VALUE]`` (far above any
#: diffusion schedule, and within what every transport and scheduler can carry).
MAX_SCHEDULE_VALUE = 1e9


def _copy_dict(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def _is_lora(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, LoRARequest):
        raise InvalidFieldError(
            type(instance).__name__, attribute.name, "must be a LoRARequest or None", value
        )


#: What a request may ask to get back besides images (``docs/outputs.md``).
OUTPUT_TYPES = ("pil", "pt", "latent")
TRAJECTORIES = ("latents", "full")


def _is_trajectory_kind(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not False and not (isinstance(value, str) and value in TRAJECTORIES):
        raise InvalidFieldError(
            type(instance).__name__, attribute.name, "must be False, 'latents' or 'full'", value
        )


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _schedule(*, integers_allowed: bool) -> Any:
    """A custom schedule: ``None``, or a non-empty, strictly decreasing list or tuple of
    at most :data:`MAX_STEPS` numbers in ``[0, MAX_SCHEDULE_VALUE]``."""
    kinds = "numbers" if integers_allowed else "floats"
    rule = (
        f"must be None or a non-empty list of at most {MAX_STEPS} {kinds} in "
        f"[0, {MAX_SCHEDULE_VALUE:g}], strictly decreasing"
    )

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, tuple) or not 1 <= len(value) <= MAX_STEPS:
            raise InvalidFieldError(type(instance).__name__, attribute.name, rule, value)
        for item in value:
            number = isinstance(item, float) or (integers_allowed and isinstance(item, int))
            if isinstance(item, bool) or not number or not 0 <= item <= MAX_SCHEDULE_VALUE:
                raise InvalidFieldError(type(instance).__name__, attribute.name, rule, value)
        if any(later >= earlier for earlier, later in itertools.pairwise(value)):
            raise InvalidFieldError(type(instance).__name__, attribute.name, rule, value)

    return check


def _is_cache(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None or value is False:
        return
    if not isinstance(value, dict):
        raise InvalidFieldError(
            type(instance).__name__, attribute.name, "must be None, False or a dict", value
        )
    check_cache_dict(type(instance).__name__, attribute.name, value, backend_key=True)


def _is_extra_args(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    str_keyed_dict(instance, attribute, value)
    bounded_input(type(instance).__name__, attribute.name, value)


@attrs.frozen(slots=True)
class SamplingParams:
    """How to sample one request. Every field is validated on construction.

    ``seed=None`` lets the engine pick one; the output reports the seed used,
    so every result can be reproduced. ``priority`` (lower runs first) and
    ``deadline_s`` (seconds after arrival by which the request should finish;
    ``None``: no deadline) are read by the scheduling policy
    (``docs/schedulers.md``); they never change the images.
    ``height``/``width`` of ``None`` mean the pipeline's native size.
    ``lora`` names the low-rank adapter to run with (``None``: the base model;
    ``docs/lora.md``). ``output_type`` ``"latent"`` returns the final latents
    instead of images (``"pil"`` and ``"pt"`` both return image tensors), and
    ``return_trajectory`` asks for every step's latents (``"latents"``) and
    also each sampled step's log-probability (``"full"``); with
    ``stream_trajectory`` each progress output of a streaming engine also
    carries the part of the trajectory recorded since the previous one; see
    ``docs/outputs.md``. ``timesteps`` or ``sigmas`` (not both) replace the
    pipeline's schedule with the given one, for pipelines that take it; the
    step count is then their length, and ``num_inference_steps`` reads back as
    that length whatever was passed. ``cache`` picks the step cache
    (``docs/caching.md``): ``None`` runs with the engine's, ``False`` with none,
    and a dict overrides the engine's settings (``backend`` among them) for
    this request. ``extra_args`` carries pipeline-specific
    options; like a prompt, it may nest at most
    :data:`~diffusion_runtime.validation.MAX_INPUT_DEPTH` levels and hold at most
    :data:`~diffusion_runtime.validation.MAX_INPUT_BYTES`.
    """

    num_inference_steps: int = attrs.field(default=25, validator=int_in_range(1, MAX_STEPS))
    guidance_scale: float = attrs.field(default=1.0, validator=finite_in_range(0.0, 1_000.0))
    seed: int | None = attrs.field(default=None, validator=int_in_range(0, MAX_SEED, optional=True))
    num_outputs_per_prompt: int = attrs.field(default=1, validator=int_in_range(1, 256))
    height: int | None = attrs.field(default=None, validator=int_in_range(1, 8192, optional=True))
    width: int | None = attrs.field(default=None, validator=int_in_range(1, 8192, optional=True))
    extra_args: dict[str, Any] = attrs.field(
        factory=dict, converter=_copy_dict, validator=_is_extra_args, hash=False
    )
    priority: int = attrs.field(default=0, validator=int_in_range(-MAX_PRIORITY, MAX_PRIORITY))
    deadline_s: float | None = attrs.field(
        default=None, validator=finite_in_range(MIN_DEADLINE_S, MAX_DEADLINE_S, optional=True)
    )
    lora: LoRARequest | None = attrs.field(default=None, validator=_is_lora)
    output_type: str = attrs.field(default="pil", validator=one_of(*OUTPUT_TYPES))
    return_trajectory: bool | str = attrs.field(default=False, validator=_is_trajectory_kind)
    stream_trajectory: bool = attrs.field(default=False, validator=is_bool)
    timesteps: tuple[int | float, ...] | None = attrs.field(
        default=None, converter=_as_tuple, validator=_schedule(integers_allowed=True)
    )
    sigmas: tuple[float, ...] | None = attrs.field(
        default=None, converter=_as_tuple, validator=_schedule(integers_allowed=False)
    )
    cache: bool | dict[str, Any] | None = attrs.field(
        default=None, converter=_copy_dict, validator=_is_cache, hash=False
    )

    def __attrs_post_init__(self) -> None:
        if self.timesteps is not None and self.sigmas is not None:
            raise InvalidFieldError(
                type(self).__name__, "sigmas", "must be None when timesteps is given", self.sigmas
            )
        if self.stream_trajectory and not self.return_trajectory:
            raise InvalidFieldError(
                type(self).__name__,
                "stream_trajectory",
                "needs return_trajectory 'latents' or 'full'",
                self.stream_trajectory,
            )
        schedule = self.custom_schedule
        if schedule is not None:  # the resolved step count, for everyone who reads it
            object.__setattr__(self, "num_inference_steps", len(schedule[1]))

    @property
    def custom_schedule(self) -> tuple[str, tuple[int | float, ...]] | None:
        """``("timesteps", ...)`` or ``("sigmas", ...)`` when the request brings its own
        schedule, else ``None``."""
        if self.timesteps is not None:
            return "timesteps", self.timesteps
        if self.sigmas is not None:
            return "sigmas", self.sigmas
        return None

    @property
    def decodes(self) -> bool:
        """Whether the request's result is decoded images (not latents)."""
        return self.output_type != "latent"

    @property
    def needs_pipeline_support(self) -> bool:
        """Whether the request asks for what a pipeline must declare it serves
        (latents, a trajectory, a custom schedule, a cache override): admission then asks the worker
        even when the pipeline has no ``validate_request``."""
        return (
            not self.decodes
            or bool(self.return_trajectory)
            or self.custom_schedule is not None
            or isinstance(self.cache, dict)
        )

    @property
    def adapter_id(self) -> int | None:
        """The id of :attr:`lora`, or ``None`` for the base model."""
        return None if self.lora is None else self.lora.adapter_id

    def request_batch_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share one full-forward (request-mode) batch.

        The adapter and a custom schedule are part of it; a step batch mixes
        adapters and schedules, so :meth:`step_batch_key` leaves them out."""
        outputs = (self.output_type == "latent", self.return_trajectory)
        return (
            self.num_inference_steps,
            self.custom_schedule,
            self.adapter_id,
            outputs,
            *self.step_batch_key(),
        )

    def step_batch_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share a denoising step, whatever their step counts."""
        extra = (
            tuple(sorted((k, repr(v)) for k, v in self.extra_args.items()))
            if self.extra_args
            else ()
        )
        return (self.guidance_scale, self.height, self.width, extra)


def checked_params(params: object) -> SamplingParams:
    """``params``, or the defaults for ``None``; anything else is an input error."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidFieldError(
            "request", "params", f"must be a SamplingParams, not {type(params).__name__}", params
        )
    return params


def prompts_and_params(
    prompts: object, params: SamplingParams | Sequence[SamplingParams] | None
) -> tuple[list[Any], list[SamplingParams | None]]:
    """One prompt list and one params entry per prompt, for a ``generate`` call.

    ``prompts`` is a list or tuple of prompts, or else one prompt; ``params`` is
    one :class:`SamplingParams` for all prompts or one per prompt.
    """
    prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
    for index, prompt in enumerate(prompt_list):
        bounded_input("generate", f"prompts[{index}]", prompt)
    if params is None or isinstance(params, SamplingParams):
        return prompt_list, [params] * len(prompt_list)
    if not isinstance(params, (list, tuple)):
        raise InvalidFieldError(
            "generate",
            "params",
            f"must be a SamplingParams or a list of them, not {type(params).__name__}",
            params,
        )
    params_list: list[SamplingParams | None] = list(params)
    if len(params_list) != len(prompt_list):
        raise InvalidFieldError(
            "generate",
            "params",
            f"must be one SamplingParams or one per prompt ({len(prompt_list)})",
            f"{len(params_list)} params",
        )
    return prompt_list, params_list
