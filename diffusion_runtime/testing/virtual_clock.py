"""VirtualClock: a clock for an :class:`~diffusion_runtime.core.EngineCore` that moves
only when a test moves it, so deadlines, aging and step costs are deterministic."""

from __future__ import annotations


class VirtualClock:
    """Seconds that pass only through :meth:`advance`; pass the instance as
    ``EngineCore(..., clock=clock)``.

    Advance it by binary fractions of a second (e.g. multiples of ``2**-8``)
    and every sum stays exact, so a deadline can fall exactly on a step.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass (a clock never goes back)."""
        if not seconds >= 0.0:
            raise ValueError(f"seconds must be >= 0; got {seconds!r}")
        self.now += seconds
