"""LoRARequest: which low-rank adapter a request runs with (see ``docs/lora.md``)."""

from __future__ import annotations

from typing import Any

import attrs

from diffusion_runtime.validation import Validator, fail, finite_in_range, int_in_range

#: ``adapter_id`` lies in ``[1, MAX_ADAPTER_ID]``; 0 is left for "no adapter".
MAX_ADAPTER_ID = 2**31 - 1
#: The longest ``name`` and ``path``, in characters.
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
#: ``scale`` lies in ``[-MAX_SCALE, MAX_SCALE]``.
MAX_SCALE = 100.0


def _text(limit: int) -> Validator:
    rule = f"must be a non-empty str of at most {limit} characters without NUL"

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, str) or not 0 < len(value) <= limit or "\0" in value:
            fail(instance, attribute.name, rule, value)

    return check


@attrs.frozen(slots=True)
class LoRARequest:
    """A low-rank adapter for one request, validated by field.

    ``adapter_id`` identifies the adapter on every worker (the runtime keys
    its slots, pins and ``list_loras`` by it); ``name`` is a label for people;
    ``path`` is the adapter file, read when the adapter is first loaded;
    ``scale`` multiplies the adapter's update (0 turns it off, negative
    values subtract it). Two requests with the same ``adapter_id`` must name
    the same adapter file.
    """

    name: str = attrs.field(validator=_text(MAX_NAME_CHARS))
    adapter_id: int = attrs.field(validator=int_in_range(1, MAX_ADAPTER_ID))
    path: str = attrs.field(validator=_text(MAX_PATH_CHARS))
    scale: float = attrs.field(default=1.0, validator=finite_in_range(-MAX_SCALE, MAX_SCALE))
