"""attrs validators whose errors name the field and the rule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from diffusion_runtime.errors import InvalidFieldError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _fail(instance: object, attribute: attrs.Attribute[Any], rule: str, value: object) -> None:
    raise InvalidFieldError(type(instance).__name__, attribute.name, rule, value)


def int_in_range(low: int, high: int, *, optional: bool = False) -> Validator:
    """An ``int`` (not a bool) in ``[low, high]``, or ``None`` when ``optional``."""
    rule = f"must be an integer in [{low}, {high}]" + (" or None" if optional else "")

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            _fail(instance, attribute, rule, value)

    return check


def finite_in_range(low: float, high: float) -> Validator:
    """A finite real number (not a bool) in ``[low, high]``."""
    rule = f"must be a finite number in [{low}, {high}]"

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not low <= value <= high
        ):
            _fail(instance, attribute, rule, value)

    return check


def one_of(*choices: object) -> Validator:
    rule = "must be one of " + ", ".join(repr(c) for c in choices)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            _fail(instance, attribute, rule, value)

    return check


def is_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        _fail(instance, attribute, "must be a bool", value)


def str_keyed_dict(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        _fail(instance, attribute, "must be a dict with str keys", value)


def fail(instance: object, field: str, rule: str, value: object) -> None:
    """Raise the error for a rule that spans fields or needs outside knowledge."""
    raise InvalidFieldError(type(instance).__name__, field, rule, value)
