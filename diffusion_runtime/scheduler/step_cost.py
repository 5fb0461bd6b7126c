"""StepCostModel: how long one denoising step takes, learnt online from the waves that ran."""

from __future__ import annotations

from collections.abc import Hashable

#: Weight of the newest sample in each moving average.
SMOOTHING = 0.2
#: The estimate before anything has been measured (a small model's step on a CPU).
DEFAULT_STEP_S = 0.001
#: Steps measured at one batch size before their fastest counts as that size's bound.
MIN_SAMPLES_FOR_BOUND = 5


class StepCostModel:
    """Exponential moving averages of the seconds per denoising step, by batch key
    and batch size (requests in the wave).

    An estimate for a (key, size) never measured falls back to the key's
    average over all sizes, then to the average over every key, then to
    :data:`DEFAULT_STEP_S`. The fastest step seen per key is kept too. Memory
    grows with the number of distinct keys and sizes seen, not with requests.
    """

    def __init__(self) -> None:
        self._by_key_and_size: dict[tuple[Hashable, int], float] = {}
        self._by_key: dict[Hashable, float] = {}
        self._last_size: dict[Hashable, int] = {}
        self._fastest: dict[Hashable, float] = {}
        self._fastest_by_size: dict[tuple[Hashable, int], float] = {}
        self._samples_by_size: dict[tuple[Hashable, int], int] = {}
        self._overall: float | None = None

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


def _blend(average: float | None, sample: float) -> float:
    return sample if average is None else average + SMOOTHING * (sample - average)
