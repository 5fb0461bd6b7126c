"""Temporary replacement of a class attribute: how a mutation plants its bug."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def replace_attribute(owner: type, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``owner.name`` with ``make(original)`` for the duration of the context."""
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)
