"""From an OpenAI images request to the engine's ``SamplingParams``."""

from __future__ import annotations

import re
from typing import Any

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.serving.config import ServerConfig
from diffusion_runtime.serving.errors import PUBLIC_FIELD_NAMES, bad_field
from diffusion_runtime.serving.schema import ImageGenerationRequest

_SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")

#: Scheduling extensions and the ``SamplingParams`` field each maps onto.
SCHEDULING_FIELDS = {"priority": "priority", "deadline": "deadline_s"}

#: Extensions that map one to one onto a ``SamplingParams`` field.
SAMPLING_FIELDS = ("num_inference_steps", "guidance_scale", "seed")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WIDTHxHEIGHT"`` as ``(height, width)``; ``None`` or ``"auto"``: the pipeline's own."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise bad_field("size", f"size: must be 'WIDTHxHEIGHT' in pixels or 'auto'; got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    return height, width


def sampling_params_for(body: ImageGenerationRequest, config: ServerConfig) -> SamplingParams:
    """The request's ``SamplingParams``; a 400 naming the field for anything not servable."""
    if len(body.prompt) > config.max_prompt_chars:
        raise bad_field(
            "prompt",
            f"prompt: must be at most {config.max_prompt_chars} characters; got {len(body.prompt)}",
        )
    n = 1 if body.n is None else body.n
    if not 1 <= n <= config.max_images_per_request:
        raise bad_field(
            "n", f"n: must be an integer in [1, {config.max_images_per_request}]; got {n}"
        )
    height, width = parse_size(body.size)
    kwargs: dict[str, Any] = {"num_outputs_per_prompt": n, "height": height, "width": width}
    kwargs.update(
        (name, getattr(body, name)) for name in SAMPLING_FIELDS if getattr(body, name) is not None
    )
    kwargs.update(
        (field, getattr(body, name))
        for name, field in SCHEDULING_FIELDS.items()
        if getattr(body, name) is not None
    )
    try:
        return SamplingParams(**kwargs)
    except InvalidFieldError as exc:
        param = PUBLIC_FIELD_NAMES.get(exc.field, exc.field)
        raise bad_field(param, f"{param}: {exc.rule}; got {exc.value!r}") from None
