"""How every benchmark times work and summarizes the samples, so a figure means one thing.

``percentile`` is the only percentile the benchmarks report (p50, p90, p99 are it at
50, 90, 99), and every duration measured in this process comes from a :class:`Stopwatch`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, interpolated linearly between the
    two closest ranks: rank ``q / 100 * (n - 1)`` of the sorted values, as numpy's default
    (``method="linear"``). So p0 is the least value, p100 the greatest, p50 the median."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100]; got {q}")
    rank = q / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def summary_us(samples_s: list[float]) -> dict[str, float]:
    """Median and 90th percentile of samples in seconds, in microseconds."""
    return {
        "median_us": round(statistics.median(samples_s) * 1e6, 1),
        "p90_us": round(percentile(samples_s, 90) * 1e6, 1),
    }


class Stopwatch:
    """Seconds since it was made, on ``clock`` (wall time unless told otherwise, e.g.
    ``time.thread_time`` for the CPU time of the calling thread)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._start = clock()

    def seconds(self) -> float:
        return self._clock() - self._start


def call_seconds(fn: Callable[[], object], count: int, warmup: int = 0) -> list[float]:
    """Seconds each of ``count`` calls of ``fn`` takes, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(count):
        watch = Stopwatch()
        fn()
        samples.append(watch.seconds())
    return samples


def interleaved_seconds(
    ways: Mapping[str, Callable[[], object]], rounds: int, warmup_rounds: int = 0
) -> dict[str, list[float]]:
    """Seconds of each way's call in each of ``rounds`` rounds, after ``warmup_rounds``
    untimed ones. A round calls every way once, in turn, so a slow spell of a shared
    machine falls on all of them alike."""
    for _ in range(warmup_rounds):
        for way in ways.values():
            way()
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            watch = Stopwatch()
            way()
            samples[name].append(watch.seconds())
    return samples


def best_wall_and_cpu(
    ways: Mapping[str, Callable[[], object]],
    rounds: int,
    cpu_clock: Callable[[], float] = time.process_time,
) -> dict[str, tuple[float, float]]:
    """Each way's best wall-clock seconds and best ``cpu_clock`` seconds over
    ``rounds`` interleaved rounds, after one untimed round (the CPU time of
    this process by default; a shared machine's other load barely moves it)."""
    for way in ways.values():
        way()
    best = dict.fromkeys(ways, (math.inf, math.inf))
    for _ in range(rounds):
        for name, way in ways.items():
            wall, cpu = Stopwatch(), Stopwatch(cpu_clock)
            way()
            best[name] = (min(best[name][0], wall.seconds()), min(best[name][1], cpu.seconds()))
    return best
