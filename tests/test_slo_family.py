"""``bench slo --family``: the generated traces, the issue's targets over the whole
family on the virtual clock, and the report's shape at a tiny size."""

from __future__ import annotations

import pytest

from diffusion_runtime.bench.slo import POLICIES
from diffusion_runtime.bench.slo_family import (
    FAMILY_SCALES,
    SHAPES,
    family,
    run,
    sample,
    serve_virtual,
    targets,
)

pytestmark = pytest.mark.usefixtures("monotonic_offset")


def test_the_family_spans_shapes_classes_scales_and_slots() -> None:
    traces = family()
    assert len(traces) >= 24
    assert {t.shape for t in traces} == set(SHAPES)
    assert {t.scale for t in traces} == set(FAMILY_SCALES)
    assert {len(t.classes) for t in traces} == {2, 3}
    assert min(t.max_num_seqs for t in traces) == 2 and max(t.max_num_seqs for t in traces) == 8
    assert traces == family(), "a family is drawn from its seed alone"
    picked = sample(traces, 6)
    assert len(set(picked)) == 6 and {t.shape for t in picked} == set(SHAPES)
    assert {t.scale for t in picked} == set(FAMILY_SCALES)
    assert sample(traces, 0) == [] and len(set(sample(traces, 40))) == len(traces)
    for trace in traces:
        assert len({a.seed for a in trace.arrivals}) == len(trace.arrivals)
        offsets = [a.offset_s for a in trace.arrivals]
        assert offsets == sorted(offsets)


def test_slo_meets_the_issue_targets_over_the_family_on_a_virtual_clock() -> None:
    """On every trace ``slo`` meets at least as many deadlines as the best of the other
    policies less one; and where it meets no more than ``edf``, the median latency
    of its requests that missed is at most twice ``edf``'s (where it meets more, it
    may have kept late requests out of the way of the deadlines it saved)."""
    short = {}
    for trace in family():
        found = targets({policy: serve_virtual(policy, trace) for policy in POLICIES})
        if not found.attainment or not (found.lateness or found.slo_met > found.edf_met):
            short[trace.name] = found
    assert not short, short


def test_the_family_report_at_a_tiny_size() -> None:
    report = run(traces=4, requests=4, real_traces=1, rounds=1, solo_repeats=1)
    assert report["traces"] == 4
    virtual = report["virtual"]["by_scale"]
    assert set(virtual) == {"1.2"}  # the first four traces share the first scale
    for policy in POLICIES:
        row = virtual["1.2"][policy]
        assert 0.0 <= row["attainment"] <= 1.0
        for kind in row["missed_by_class"].values():
            assert kind["missed"] == 0 or kind["p50_ms"] <= kind["p99_ms"]
    real = report["real"]["by_trace"]
    assert len(real) == 1
    (rows,) = real.values()
    assert len(rows) == 1 and all(0 <= rows[0][p]["met"] <= 4 for p in POLICIES)
