"""StepCostModel: how long a denoising step and a request's start take, learnt online
from the waves that ran."""

from __future__ import annotations

from collections.abc import Hashable

#: Weight of the newest sample in each moving average.
SMOOTHING = 0.2
#: The estimate before anything has been measured (a small model's step on a CPU).
DEFAULT_STEP_S = 0.001
#: Steps measured at one batch size before their fastest counts as that size's bound.
MIN_SAMPLES_FOR_BOUND = 5
#: Seconds without a step after which the engine counts as idle: its next start is cold.
IDLE_AFTER_S = 0.05


class StepCostModel:
    """Exponential moving averages of the seconds per denoising step, by batch key
    and batch size (requests in the wave).

    An estimate for a (key, size) never measured falls back to the key's
    average over all sizes, then to the average over every key, then to
    :data:`DEFAULT_STEP_S`. The fastest step seen per key is kept too.

    It also learns each key's *start cost*: how much longer the first waves
    after requests start take than ordinary steps (building their states, and
    on an engine that sat idle, the slow first steps of a cold machine), as
    moving averages kept apart for starts on an idle engine and on a busy one;
    and its *finish cost*: how much longer a wave in which requests take their
    last step takes than an ordinary step (decoding their images, which on a
    pipeline with a heavy decoder costs several steps). Memory grows with the
    number of distinct keys and sizes seen, not with requests.
    """

    def __init__(self) -> None:
        self._by_key_and_size: dict[tuple[Hashable, int], float] = {}
        self._by_key: dict[Hashable, float] = {}
        self._last_size: dict[Hashable, int] = {}
        self._fastest: dict[Hashable, float] = {}
        self._fastest_by_size: dict[tuple[Hashable, int], float] = {}
        self._samples_by_size: dict[tuple[Hashable, int], int] = {}
        self._overall: float | None = None
        self._start: dict[tuple[Hashable, bool], float] = {}
        self._finish: dict[Hashable, float] = {}
        self._least_finish: dict[Hashable, float] = {}
        self._finish_samples: dict[Hashable, int] = {}
        self._last_wave_end: float | None = None

    def observe(self, key: Hashable, batch_size: int, seconds_per_step: float) -> None:
        """Record that a wave of ``batch_size`` requests of ``key`` took this long per step."""
        self._by_key_and_size[key, batch_size] = _blend(
            self._by_key_and_size.get((key, batch_size)), seconds_per_step
        )
        self._by_key[key] = _blend(self._by_key.get(key), seconds_per_step)
        self._last_size[key] = batch_size
        self._fastest[key] = min(self._fastest.get(key, seconds_per_step), seconds_per_step)
        self._fastest_by_size[key, batch_size] = min(
            self._fastest_by_size.get((key, batch_size), seconds_per_step), seconds_per_step
        )
        self._samples_by_size[key, batch_size] = self._samples_by_size.get((key, batch_size), 0) + 1
        self._overall = _blend(self._overall, seconds_per_step)

    def seconds_per_step(self, key: Hashable, batch_size: int | None = None) -> float:
        """The current estimate for one step of a wave of ``batch_size`` requests of
        ``key`` (``None``: the size of the last wave of ``key``)."""
        if batch_size is None:
            batch_size = self._last_size.get(key, 1)
        estimate = self._by_key_and_size.get((key, batch_size))
        if estimate is None:
            estimate = self._by_key.get(key, self._overall)
        return DEFAULT_STEP_S if estimate is None else estimate

    def fastest_seconds_per_step(self, key: Hashable, batch_size: int | None = None) -> float:
        """The fastest step measured so far for ``key`` at ``batch_size`` (``None``:
        the size of the last wave of ``key``) once :data:`MIN_SAMPLES_FOR_BOUND`
        steps were measured at that size, else at any size, else the estimate:
        a lower bound on what the next steps will take.

        The minimum of a few steps is no bound: the first steps after the
        machine sat idle run up to twice as slow (digits on a CPU: 1.6-2.9 ms
        against 1.2), and one of them as a size's only sample would make a
        request due in time look hopeless.
        """
        if batch_size is None:
            batch_size = self._last_size.get(key, 1)
        if self._samples_by_size.get((key, batch_size), 0) >= MIN_SAMPLES_FOR_BOUND:
            fastest: float | None = self._fastest_by_size[key, batch_size]
        else:
            fastest = self._fastest.get(key)
        return self.seconds_per_step(key, batch_size) if fastest is None else fastest

    def wave_ended(self, at: float) -> None:
        """Record that a wave that ran steps ended at ``at`` (the scheduler's clock)."""
        self._last_wave_end = at

    @property
    def last_wave_end(self) -> float | None:
        """When the last wave that ran steps ended (``None``: none yet)."""
        return self._last_wave_end

    def is_idle(self, now: float) -> bool:
        """Whether no wave ended in the last :data:`IDLE_AFTER_S` before ``now``."""
        end = self._last_wave_end
        return end is None or now - end >= IDLE_AFTER_S

    def observe_start(self, key: Hashable, idle: bool, extra_seconds: float) -> None:
        """Record that the first waves after requests of ``key`` started took
        ``extra_seconds`` longer than ordinary steps; ``idle``: the engine was idle."""
        self._start[key, idle] = _blend(self._start.get((key, idle)), extra_seconds)

    def start_seconds(self, key: Hashable, idle: bool) -> float:
        """What starting requests of ``key`` costs beyond their steps, on an idle or a
        busy engine (the other kind's average until this one is measured; 0 before
        any, and never negative)."""
        cost = self._start.get((key, idle), self._start.get((key, not idle), 0.0))
        return max(0.0, cost)

    def observe_finish(self, key: Hashable, batch_size: int, wave_seconds: float) -> None:
        """Record that a wave of ``batch_size`` requests of ``key`` in which requests
        took their last step took ``wave_seconds``: what it took beyond the average
        step at that size is a finish cost. Ignored while no step of that size was
        measured (it would be set against a fallback estimate)."""
        step_s = self._by_key_and_size.get((key, batch_size))
        if step_s is None:
            return
        extra = wave_seconds - step_s
        self._finish[key] = _blend(self._finish.get(key), extra)
        self._least_finish[key] = min(self._least_finish.get(key, extra), extra)
        self._finish_samples[key] = self._finish_samples.get(key, 0) + 1

    def finish_seconds(self, key: Hashable, least: bool = False) -> float:
        """What a request's last step of ``key`` costs beyond an ordinary step: the
        moving average; with ``least``, once :data:`MIN_SAMPLES_FOR_BOUND` were
        measured, the smallest (a bound, as the fastest step is). 0 before any,
        and never negative."""
        enough = self._finish_samples.get(key, 0) >= MIN_SAMPLES_FOR_BOUND
        cost = (self._least_finish if least and enough else self._finish).get(key, 0.0)
        return max(0.0, cost)


def _blend(average: float | None, sample: float) -> float:
    return sample if average is None else average + SMOOTHING * (sample - average)
