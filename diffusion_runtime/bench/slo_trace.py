"""The trace of the ``slo`` benchmark: three request classes, Poisson and bursty arrivals."""

from __future__ import annotations

import itertools
import random

import attrs

from diffusion_runtime.sampling_params import SamplingParams


@attrs.frozen
class RequestClass:
    """One kind of request in the trace; ``priority`` is what the ``priority`` policy reads."""

    name: str
    steps: int
    outputs: int
    size: int | None
    share: float
    priority: int

    def params(self, seed: int, deadline_s: float | None = None) -> SamplingParams:
        return SamplingParams(
            num_inference_steps=self.steps,
            num_outputs_per_prompt=self.outputs,
            height=self.size,
            width=self.size,
            seed=seed,
            priority=self.priority,
            deadline_s=deadline_s,
        )


CLASSES = (
    RequestClass("short", steps=10, outputs=1, size=None, share=0.6, priority=0),
    RequestClass("medium", steps=25, outputs=2, size=16, share=0.25, priority=1),
    RequestClass("long", steps=100, outputs=1, size=None, share=0.15, priority=2),
)


@attrs.frozen
class Arrival:
    """One request of a trace, ``offset_s`` after the trace starts. Arrivals of one
    ``burst`` come at once; a Poisson trace is one burst, as it cannot be split."""

    offset_s: float
    kind: RequestClass
    seed: int
    burst: int = 0


def _pick(rng: random.Random) -> RequestClass:
    return rng.choices(CLASSES, weights=[c.share for c in CLASSES])[0]


def poisson_trace(count: int, rate_per_s: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    t, trace = 0.0, []
    for index in range(count):
        t += rng.expovariate(rate_per_s)
        trace.append(Arrival(t, _pick(rng), index))
    return trace


def bursty_trace(count: int, burst_size: int, mean_gap_s: float, seed: int) -> list[Arrival]:
    """Bursts of ``burst_size`` requests at once, separated by exponential gaps."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for index in range(count):
        if index % burst_size == 0:
            t += rng.expovariate(1.0 / mean_gap_s)
        trace.append(Arrival(t, _pick(rng), index, index // burst_size))
    return trace


def bursts(trace: list[Arrival]) -> list[list[Arrival]]:
    """``trace`` split into its bursts, in order."""
    return [list(burst) for _, burst in itertools.groupby(trace, key=lambda a: a.burst)]
