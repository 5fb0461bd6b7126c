"""The shape of a mutation: a named bug, the harness target that must catch it,
and the patch that plants it. The catalogue modules build theirs from it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import attrs

#: What a mutation's ``patch()`` returns: the bug is in place while it is open.
Patch = contextlib.AbstractContextManager[None]


@attrs.frozen(kw_only=True)
class Mutation:
    """A named bug: ``patch()`` applies it while its context is open."""

    name: str
    bug: str
    #: The execution mode the harness runs in: ``"request"`` or ``"step"``.
    mode: str
    #: What the harness drives: a key of :data:`~diffusion_runtime.testing.targets.HARNESSES`.
    target: str
    patch: Callable[[], Patch]
