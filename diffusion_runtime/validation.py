"""attrs validators whose errors name the field and the rule, and the input bounds.

Every validator here raises :class:`InvalidFieldError` for any value, never
``OverflowError``, ``TypeError`` or a ``RecursionError``: a check runs only
operations that are defined for the types it already tested.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy
import torch

from diffusion_runtime.errors import InvalidFieldError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

#: The deepest nesting of containers a prompt or ``extra_args`` may have.
MAX_INPUT_DEPTH = 32
#: The largest estimated size, in bytes, of one prompt or one ``extra_args``.
MAX_INPUT_BYTES = 64 * 1024 * 1024
#: What an item of unknown size (a number, an object) counts towards the size.
_ITEM_BYTES = 8


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


def finite_in_range(low: float, high: float, *, optional: bool = False) -> Validator:
    """A finite real number (not a bool) in ``[low, high]``, or ``None`` when ``optional``.

    An ``int`` is compared exactly: converting ``10**400`` to a float overflows.
    """
    rule = f"must be a finite number in [{low}, {high}]" + (" or None" if optional else "")

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(instance, attribute, rule, value)
        if isinstance(value, float) and not math.isfinite(value):
            _fail(instance, attribute, rule, value)
        if not low <= value <= high:
            _fail(instance, attribute, rule, value)

    return check


def one_of(*choices: str) -> Validator:
    """One of the strings ``choices``."""
    rule = "must be one of " + ", ".join(repr(c) for c in choices)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        # Test the type first: ``in`` would call an arbitrary object's ``__eq__``.
        if not isinstance(value, str) or value not in choices:
            _fail(instance, attribute, rule, value)

    return check


def is_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        _fail(instance, attribute, "must be a bool", value)


def str_keyed_dict(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        _fail(instance, attribute, "must be a dict with str keys", value)


def bounded_input(owner: str, field: str, value: object) -> None:
    """Refuse ``value`` if its containers nest deeper than :data:`MAX_INPUT_DEPTH`
    or its estimated size passes :data:`MAX_INPUT_BYTES`.

    The walk is iterative, so no depth makes it (or, once it passed, pickling
    or ``repr``) raise ``RecursionError``. Containers are lists, tuples, sets
    and dicts; strings, bytes, arrays and tensors count their length in bytes;
    anything else counts as one small item. A container met twice counts once.
    """
    size = 0
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, set, frozenset, dict)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            if depth > MAX_INPUT_DEPTH:
                raise InvalidFieldError(
                    owner, field, f"must not nest deeper than {MAX_INPUT_DEPTH} levels", value
                )
            size += _ITEM_BYTES * len(item) * (2 if isinstance(item, dict) else 1)
            if size <= MAX_INPUT_BYTES:
                children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
                stack.extend((child, depth + 1) for child in children)
        else:
            size += _leaf_bytes(item)
        if size > MAX_INPUT_BYTES:
            raise InvalidFieldError(
                owner, field, f"must not be larger than {MAX_INPUT_BYTES} bytes", value
            )


def _leaf_bytes(item: object) -> int:
    if isinstance(item, str):
        return len(item)
    if isinstance(item, (bytes, bytearray)):
        return len(item)
    if isinstance(item, memoryview):
        return item.nbytes
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, numpy.ndarray):
        return int(item.nbytes)
    return _ITEM_BYTES


def fail(instance: object, field: str, rule: str, value: object) -> None:
    """Raise the error for a rule that spans fields or needs outside knowledge."""
    raise InvalidFieldError(type(instance).__name__, field, rule, value)
