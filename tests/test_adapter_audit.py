"""The adapter invariants INV-013..015: each flags the trace that breaks it, and a
real engine's trace with adapters (written to a file and read back) is clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_adapters import adapter

from diffusion_runtime import EngineConfig, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.fsm.audit import audit_events
from diffusion_runtime.fsm.events import (
    AdapterEvent,
    EngineEvent,
    LifecycleEvent,
    TraceEvent,
    WaveEvent,
    event_from_json,
)
from diffusion_runtime.fsm.trace import read_trace

W, R = RequestStatus.WAITING, RequestStatus.RUNNING


def table(action: str, adapter_id: int, rid: str | None = None) -> AdapterEvent:
    return AdapterEvent(action, adapter_id, 0.0, rid, max_loras=1, max_cpu_loras=2)


def admitted(rid: str, adapter_id: int) -> list[TraceEvent]:
    return [LifecycleEvent(rid, None, W, "admit", None, 0.0), table("used", adapter_id, rid)]


def invariants(events: list[TraceEvent]) -> list[str]:
    """The invariants the adapter checkers flag in ``events`` (an open trace)."""
    found = audit_events([EngineEvent("started", 0.0), *events])
    return sorted({v.invariant for v in found if v.invariant >= "INV-013"})


def test_a_trace_within_the_rules_is_clean() -> None:
    events = [
        table("loaded", 1),
        table("pinned", 1),
        table("loaded", 2),
        *admitted("a", 2),
        table("refused", 3, "c"),  # no room: 1 is pinned, 2 is in use
    ]
    assert invariants(events) == []


@pytest.mark.parametrize(
    ("events", "invariant"),
    [
        # three loaded with max_cpu_loras = 2
        ([table("loaded", 1), table("loaded", 2), table("loaded", 3)], "INV-013"),
        # a request admitted with an adapter that is not loaded
        (admitted("a", 1), "INV-013"),
        # a wave of two adapters with max_loras = 1
        (
            [
                table("loaded", 1),
                table("loaded", 2),
                *admitted("a", 1),
                *admitted("b", 2),
                LifecycleEvent("a", W, R, "schedule", 0, 0.0),
                LifecycleEvent("b", W, R, "schedule", 0, 0.0),
                WaveEvent(0, ("a", "b"), (), (), 0.0),
            ],
            "INV-013",
        ),
        # refused although adapter 1 could have been evicted
        ([table("loaded", 1), table("loaded", 2), table("refused", 3, "c")], "INV-013"),
        # a pinned adapter evicted
        ([table("loaded", 1), table("pinned", 1), table("evicted", 1)], "INV-014"),
        # an adapter evicted, then removed, while a waiting request uses it
        ([table("loaded", 1), *admitted("a", 1), table("evicted", 1)], "INV-015"),
        ([table("loaded", 1), *admitted("a", 1), table("removed", 1)], "INV-015"),
    ],
)
def test_each_adapter_invariant_flags_the_trace_that_breaks_it(
    events: list[TraceEvent], invariant: str
) -> None:
    assert invariant in invariants(events)


def test_an_adapter_is_free_again_once_its_request_ended() -> None:
    ended = LifecycleEvent("a", W, RequestStatus.FINISHED_ABORTED, "abort", None, 0.0)
    assert invariants([table("loaded", 1), *admitted("a", 1), ended, table("removed", 1)]) == []


def test_a_real_engines_adapter_trace_reads_back_and_is_clean(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    config = EngineConfig(
        pipeline="digits",
        device="cpu",
        warmup=False,
        execution_mode="step",
        max_loras=1,
        max_cpu_loras=1,
        trace_path=str(trace),
    )
    core = EngineCore(config)
    one, two = adapter(tmp_path, 1), adapter(tmp_path, 2)
    core.add_lora(one)
    core.pin_lora(1)
    core.remove_lora(1)
    core.add_request("a", 3, SamplingParams(num_inference_steps=2, seed=0, lora=two), 0)
    while core.has_unfinished():
        core.step()
    core.shutdown()
    events = list(read_trace(trace))
    actions = [(e.action, e.adapter_id) for e in events if isinstance(e, AdapterEvent)]
    assert actions == [("loaded", 1), ("pinned", 1), ("removed", 1), ("loaded", 2), ("used", 2)]
    assert audit_events(events) == []
    record = json.loads(trace.read_text().splitlines()[1])
    assert event_from_json(record) == events[1]
