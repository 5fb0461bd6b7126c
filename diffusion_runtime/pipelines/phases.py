"""Where a request's time goes on its worker: encoding, denoising and decoding.

The runner times every pipeline call it makes. In step mode each call is one
phase (``prepare_encode`` encodes, a step denoises, ``post_decode`` decodes).
A request-mode ``forward`` does all three in one call, so it marks its encode
and decode parts with :func:`timed_phase`; what it leaves unmarked counts as
denoising. A ``forward`` that marks nothing reports all its time as
denoising. Times are host wall-clock seconds: on CUDA, work that is only
enqueued when a phase ends is counted where the host waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: The phases of a request's work on its worker, in the order they run.
PHASES = ("encode", "denoise", "decode")


class PhaseClock:
    """Seconds spent in each phase, summed over the calls timed with it."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the enclosed work's duration to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start


_forward = threading.local()


@contextmanager
def timed_phase(phase: str) -> Iterator[None]:
    """Count the enclosed part of a request-mode ``forward`` as ``phase``
    (``"encode"`` or ``"decode"``). Outside a forward the runner times, it
    does nothing."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}; got {phase!r}")
    clock: PhaseClock | None = getattr(_forward, "clock", None)
    if clock is None:
        yield
        return
    with clock.timing(phase):
        yield


@contextmanager
def timing_forward() -> Iterator[PhaseClock]:
    """Time one ``forward`` call: the parts it marks with :func:`timed_phase`
    go to their phases, the rest to ``"denoise"``."""
    clock = PhaseClock()
    outer = getattr(_forward, "clock", None)
    _forward.clock = clock
    start = time.perf_counter()
    try:
        yield clock
    finally:
        _forward.clock = outer
        marked = clock.seconds["encode"] + clock.seconds["decode"]
        clock.seconds["denoise"] += max(0.0, time.perf_counter() - start - marked)
