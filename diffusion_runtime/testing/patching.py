"""Temporary replacement of a class attribute: how a mutation plants its bug.

A stage process is spawned, so a patch in this process never reaches it:
:func:`spawn_stages_running` makes the stages spawned meanwhile start from
another entry point, one that plants the bug in the child before serving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from diffusion_runtime.stage import process as stage_process
from diffusion_runtime.stage.proc import StageSpec


@contextlib.contextmanager
def replace_attribute(
    owner: type | ModuleType, name: str, make: Callable[[Any], Any]
) -> Iterator[None]:
    """Replace ``owner.name`` with ``make(original)`` for the duration of the context."""
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def spawn_stages_running(
    entry: Callable[[StageSpec], None],
) -> contextlib.AbstractContextManager[None]:
    """Stage processes spawned while the context is open run ``entry(spec)`` instead
    of ``run_stage(spec)``; ``entry`` must be picklable (a module-level function,
    or a ``functools.partial`` of one)."""
    return replace_attribute(stage_process, "run_stage", lambda original: entry)
