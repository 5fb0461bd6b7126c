"""Per-request sampling parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.validation import (
    bounded_input,
    finite_in_range,
    int_in_range,
    one_of,
    str_keyed_dict,
)

MAX_SEED = 2**63 - 1
#: ``priority`` lies in ``[-MAX_PRIORITY, MAX_PRIORITY]``.
MAX_PRIORITY = 2**31 - 1
#: ``deadline_s`` lies in ``[MIN_DEADLINE_S, MAX_DEADLINE_S]`` (1 ms to 30 days).
MIN_DEADLINE_S = 0.001
MAX_DEADLINE_S = 30 * 86_400.0


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
    also each sampled step's log-probability (``"full"``); see
    ``docs/outputs.md``. ``extra_args`` carries pipeline-specific options; like a prompt, it may
    nest at most :data:`~diffusion_runtime.validation.MAX_INPUT_DEPTH` levels
    and hold at most :data:`~diffusion_runtime.validation.MAX_INPUT_BYTES`.
    """

    num_inference_steps: int = attrs.field(default=25, validator=int_in_range(1, 10_000))
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

    @property
    def decodes(self) -> bool:
        """Whether the request's result is decoded images (not latents)."""
        return self.output_type != "latent"

    @property
    def adapter_id(self) -> int | None:
        """The id of :attr:`lora`, or ``None`` for the base model."""
        return None if self.lora is None else self.lora.adapter_id

    def request_batch_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share one full-forward (request-mode) batch.

        The adapter is part of it; a step batch mixes adapters, so
        :meth:`step_batch_key` leaves it out."""
        outputs = (self.output_type == "latent", self.return_trajectory)
        return (self.num_inference_steps, self.adapter_id, outputs, *self.step_batch_key())

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
