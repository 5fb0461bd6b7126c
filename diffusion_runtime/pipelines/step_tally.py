"""How many steps of a request-mode ``forward`` ran the model, and how many reused its output.

The runner counts the steps it takes in step mode itself. A request-mode
``forward`` runs all of a request's steps in one call, so it reports each
step with :func:`tally_step` (:func:`~diffusion_runtime.pipelines.protocols.forward_by_steps`
does); outside a forward the runner tallies, it does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Request id -> (model evaluations, cached steps).
StepCounts = dict[str, tuple[int, int]]

_forward = threading.local()


def tally_step(request_id: str, *, cached: bool) -> None:
    """Count one step of ``request_id`` taken inside the tallied forward."""
    counts: StepCounts | None = getattr(_forward, "counts", None)
    if counts is None:
        return
    ran, reused = counts.get(request_id, (0, 0))
    counts[request_id] = (ran, reused + 1) if cached else (ran + 1, reused)


@contextmanager
def tallying_steps() -> Iterator[StepCounts]:
    """Collect the steps reported with :func:`tally_step` during one ``forward``."""
    counts: StepCounts = {}
    outer = getattr(_forward, "counts", None)
    _forward.counts = counts
    try:
        yield counts
    finally:
        _forward.counts = outer
