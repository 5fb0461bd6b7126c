"""The benchmarks' one percentile is numpy's linear one, and their timers give seconds."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from diffusion_runtime.bench.stats import (
    Stopwatch,
    call_seconds,
    interleaved_seconds,
    percentile,
    summary_us,
)

samples = st.lists(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=50,
)
quantiles = st.floats(min_value=0, max_value=100, allow_nan=False)


@given(samples, quantiles)
def test_the_percentile_is_numpys_linear_one(values: list[float], q: float) -> None:
    expected = float(np.percentile(values, q, method="linear"))
    assert percentile(values, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


@given(samples)
def test_p0_is_the_least_p100_the_greatest_and_p50_the_median(values: list[float]) -> None:
    assert percentile(values, 0) == min(values)
    assert percentile(values, 100) == max(values)
    assert percentile(values, 50) == pytest.approx(float(np.median(values)), abs=1e-6)


@given(st.floats(allow_nan=False, allow_infinity=False), quantiles)
def test_every_percentile_of_one_value_is_that_value(value: float, q: float) -> None:
    assert percentile([value], q) == value


def test_the_percentile_interpolates_between_the_two_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(iter(values), 25) == 1.75


@pytest.mark.parametrize("q", [-1, 100.5])
def test_a_quantile_outside_0_to_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="q must be within"):
        percentile([1.0, 2.0], q)


def test_no_values_have_no_percentile() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_the_summary_reports_the_median_and_p90_in_microseconds() -> None:
    assert summary_us([1e-6 * v for v in range(11)]) == {"median_us": 5.0, "p90_us": 9.0}


def test_a_stopwatch_counts_non_negative_seconds_on_its_clock() -> None:
    wall, cpu = Stopwatch(), Stopwatch(time.thread_time)
    first = wall.seconds()
    assert 0 <= first <= wall.seconds()
    assert cpu.seconds() >= 0


def test_call_seconds_times_each_call_after_the_warmup() -> None:
    calls: list[int] = []
    seconds = call_seconds(lambda: calls.append(1), 5, warmup=3)
    assert len(calls) == 8 and len(seconds) == 5
    assert all(s >= 0 for s in seconds)
    assert sorted(seconds)[0] <= sorted(seconds)[-1]


def test_interleaved_seconds_calls_every_way_once_per_round_in_turn() -> None:
    order: list[str] = []
    ways = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
    seconds = interleaved_seconds(ways, 3, warmup_rounds=1)
    assert order == ["a", "b"] * 4
    assert {name: len(s) for name, s in seconds.items()} == {"a": 3, "b": 3}
    assert all(s >= 0 for samples in seconds.values() for s in samples)
