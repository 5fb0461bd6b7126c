"""The HTTP server's own limits and names (the engine's live in ``EngineConfig``)."""

from __future__ import annotations

import attrs

from diffusion_runtime.validation import fail, finite_in_range, int_in_range, is_bool


def _is_optional_name(
    instance: object, attribute: attrs.Attribute[str | None], value: object
) -> None:
    if value is not None and not (isinstance(value, str) and value.strip()):
        fail(instance, attribute.name, "must be a non-empty str or None", value)


@attrs.frozen(slots=True)
class ServerConfig:
    """Limits and names of the OpenAI-compatible images API. Every field is validated.

    ``model_name`` is the one model the server answers to (default: the
    engine's pipeline name). ``max_body_bytes`` bounds a request body (413
    beyond it), ``max_prompt_chars`` a prompt and ``max_images_per_request``
    the OpenAI ``n`` (400 beyond them). ``per_client_limit`` bounds the
    requests one client (its OpenAI ``user``, else its address) may have in
    flight; ``None`` means no bound. ``retry_after_s`` is the ``Retry-After``
    sent with a 429. Images asked for as ``url`` are kept ``image_ttl_s``
    seconds, at most ``max_stored_images`` of them. A progress stream sends a
    keep-alive comment after ``stream_keepalive_s`` seconds of silence.
    ``admin_routes`` adds the operator's ``/admin/...`` routes (sleep, wake,
    profile; ``docs/operations.md``), off by default. ``lora_updates`` adds
    ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    (``docs/lora.md``), off by default.
    """

    model_name: str | None = attrs.field(default=None, validator=_is_optional_name)
    max_body_bytes: int = attrs.field(default=65_536, validator=int_in_range(64, 2**30))
    max_prompt_chars: int = attrs.field(default=4_000, validator=int_in_range(1, 2**20))
    max_images_per_request: int = attrs.field(default=10, validator=int_in_range(1, 256))
    per_client_limit: int | None = attrs.field(
        default=None, validator=int_in_range(1, 2**20, optional=True)
    )
    retry_after_s: int = attrs.field(default=1, validator=int_in_range(0, 86_400))
    image_ttl_s: float = attrs.field(default=3_600.0, validator=finite_in_range(1.0, 604_800.0))
    max_stored_images: int = attrs.field(default=1_024, validator=int_in_range(1, 2**24))
    stream_keepalive_s: float = attrs.field(default=15.0, validator=finite_in_range(0.01, 3_600.0))
    admin_routes: bool = attrs.field(default=False, validator=is_bool)
    lora_updates: bool = attrs.field(default=False, validator=is_bool)
