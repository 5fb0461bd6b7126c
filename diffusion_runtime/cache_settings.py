"""Step-cache settings: which cache a request's denoising uses, and its knobs.

The engine names a backend and its settings (``EngineConfig.cache_backend`` and
``cache_config``); a request may opt out (``SamplingParams(cache=False)``) or
override any setting, the backend included (``cache={...}``). What a request
runs with is :func:`effective_cache`. See ``docs/caching.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.validation import finite_in_range, int_in_range

#: The step caches a pipeline may serve (it names those it does in ``cache_backends``).
CACHE_BACKENDS = ("tea_cache", "first_block")
#: The largest threshold accepted (an accumulated relative L1 change far above any step's).
MAX_REL_L1_THRESH = 1_000.0
_MAX_STEPS = 10_000


@attrs.frozen(slots=True)
class CacheSettings:
    """One request's step cache.

    ``rel_l1_thresh``: a step reuses the previous model output while the
    accumulated relative L1 change of the model's input since the last computed
    step stays below it (0: never reuse). ``warmup_steps``: the first steps,
    which always compute. The last step always computes too (it makes the image
    the request returns). ``max_consecutive_skips``: at most this many steps in
    a row reuse an output (``None``: no bound).
    """

    backend: str = attrs.field(default="tea_cache")
    rel_l1_thresh: float = attrs.field(
        default=0.1, validator=finite_in_range(0.0, MAX_REL_L1_THRESH)
    )
    warmup_steps: int = attrs.field(default=1, validator=int_in_range(0, _MAX_STEPS))
    max_consecutive_skips: int | None = attrs.field(
        default=None, validator=int_in_range(1, _MAX_STEPS, optional=True)
    )


#: The keys a cache settings dict may hold (``backend`` only in a request's override).
CACHE_KEYS = tuple(a.name for a in attrs.fields(CacheSettings) if a.name != "backend")


def check_backend(owner: str, field: str, value: object, *, optional: bool) -> None:
    """Refuse anything but a known backend name (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or value not in CACHE_BACKENDS:
        choices = ", ".join(repr(b) for b in CACHE_BACKENDS)
        rule = f"must be one of {choices}" + (" or None" if optional else "")
        raise InvalidFieldError(owner, field, rule, value)


def check_cache_dict(owner: str, field: str, value: object, *, backend_key: bool) -> None:
    """Refuse a settings dict with an unknown key or an out-of-range value, naming
    the key (``field['key']``); ``backend_key``: it may also name the backend."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidFieldError(owner, field, "must be a dict with str keys", value)
    known = (*CACHE_KEYS, "backend") if backend_key else CACHE_KEYS
    for key in value:
        if key not in known:
            rule = "is not a cache setting; known: " + ", ".join(known)
            raise InvalidFieldError(owner, f"{field}[{key!r}]", rule, value[key])
    if "backend" in value:
        check_backend(owner, f"{field}['backend']", value["backend"], optional=False)
    try:
        CacheSettings(**{k: v for k, v in value.items() if k != "backend"})
    except InvalidFieldError as exc:
        raise InvalidFieldError(owner, f"{field}[{exc.field!r}]", exc.rule, exc.value) from None


def effective_cache(
    backend: str | None, config: Mapping[str, Any], request: bool | dict[str, Any] | None
) -> CacheSettings | None:
    """The cache a request runs with: the engine's ``backend`` and ``config``,
    overridden by the request's dict, or none (``request`` is ``False``, or
    neither names a backend). Both were checked on construction."""
    if request is False:
        return None
    override = request if isinstance(request, dict) else {}
    chosen = override.get("backend", backend)
    if chosen is None:
        return None
    settings = {**config, **override, "backend": chosen}
    return CacheSettings(**settings)
