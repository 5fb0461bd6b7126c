"""INV-007..011 (policy and effect) online and offline, and the Perfetto export."""

from __future__ import annotations

import json
from pathlib import Path

from diffusion_runtime import DiffusionEngine, EngineConfig, SamplingParams
from diffusion_runtime.cli import main
from diffusion_runtime.fsm import DEADLINE_REASON, RequestStatus
from diffusion_runtime.fsm.audit import audit_events
from diffusion_runtime.fsm.events import (
    AbortEvent,
    DeliveryEvent,
    LifecycleEvent,
    RunnerEvent,
    TraceEvent,
    WaveEvent,
    event_from_json,
)
from diffusion_runtime.fsm.perfetto import chrome_trace
from diffusion_runtime.fsm.trace import read_trace
from diffusion_runtime.testing.mutations import CATALOGUE

W, R, P = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED
DONE, ABORTED = RequestStatus.FINISHED_COMPLETED, RequestStatus.FINISHED_ABORTED


def admitted(rid: str, t: float = 0.0) -> LifecycleEvent:
    return LifecycleEvent(rid, None, W, "admit", None, t)


def invariants(events: list[TraceEvent]) -> list[str]:
    return sorted({v.invariant for v in audit_events(events)})


def test_a_wave_over_capacity_or_mixing_keys_is_flagged() -> None:
    events: list[TraceEvent] = [admitted(r) for r in "abc"]
    events += [LifecycleEvent(r, W, R, "schedule", 0, 1.0) for r in "abc"]
    events.append(
        WaveEvent(0, ("a", "b", "c"), (), (), 1.0, ("k1", "k1", "k2"), (2, 3, 2), 2, "request")
    )
    messages = [v.message for v in audit_events(events) if v.invariant == "INV-007"]
    assert any("max_num_seqs is 2" in m for m in messages)
    assert any("mixes compatibility keys" in m for m in messages)
    assert any("mixes step counts" in m for m in messages)


def test_an_abort_that_does_not_end_the_request_is_flagged() -> None:
    events: list[TraceEvent] = [
        admitted("a"),
        LifecycleEvent("a", W, R, "schedule", 0, 1.0),
        WaveEvent(0, ("a",), (), (), 1.0, ("k",), (3,), 4, "step"),
        RunnerEvent(0, ("a",), (), ("a",), (), ("a",), (), 1.1, ((1, 3),)),
        AbortEvent("a", "aborted by the caller", 1.2),
        WaveEvent(1, (), ("a",), (), 1.3, ("k",), (3,), 4, "step"),
    ]
    assert "INV-008" in invariants(events)
    ended = [*events[:5], LifecycleEvent("a", R, ABORTED, "abort", None, 1.25)]
    assert "INV-008" not in invariants(ended)


def test_a_completion_after_the_wrong_number_of_steps_is_flagged() -> None:
    events: list[TraceEvent] = [
        admitted("a"),
        LifecycleEvent("a", W, R, "schedule", 0, 1.0),
        WaveEvent(0, ("a",), (), (), 1.0, ("k",), (3,), 4, "step"),
        RunnerEvent(0, ("a",), (), ("a",), (), ("a",), (), 1.1, ((1, 3),)),
        WaveEvent(1, (), ("a",), (), 1.2, ("k",), (3,), 4, "step"),
        RunnerEvent(1, ("a",), ("a",), ("a",), (), (), ("a",), 1.3, ((2, 3),)),
        LifecycleEvent("a", R, DONE, "complete", 1, 1.4),
    ]
    messages = [v.message for v in audit_events(events) if v.invariant == "INV-009"]
    assert messages == ["completed after 2 of its 3 requested steps"]


def test_a_progress_output_marked_final_is_flagged() -> None:
    events: list[TraceEvent] = [admitted("a"), DeliveryEvent("a", R, True, "", "", 1.0)]
    assert "INV-010" in invariants(events)


def test_a_deadline_drop_of_a_running_request_is_flagged() -> None:
    def dropped_from(source: RequestStatus) -> list[str]:
        drop = LifecycleEvent("a", source, ABORTED, "abort", None, 2.0, DEADLINE_REASON)
        events: list[TraceEvent] = [admitted("a"), drop]
        if source is not W:
            events.insert(1, LifecycleEvent("a", W, R, "schedule", 0, 1.0))
        if source is P:
            events.insert(2, LifecycleEvent("a", R, P, "preempt", None, 1.5))
        return [v.message for v in audit_events(events) if v.invariant == "INV-011"]

    assert dropped_from(R) == ["dropped for its deadline while RUNNING"]
    assert dropped_from(W) == dropped_from(P) == []


def test_new_event_fields_survive_the_json_round_trip() -> None:
    wave = WaveEvent(3, ("a",), ("b",), ("c",), 1.5, ("k", "k"), (2, 4), 8, "step")
    runner = RunnerEvent(3, ("b", "a"), (), ("b", "a"), (), ("a",), (), 1.6, ((2, 4), (1, 2)))
    abort = AbortEvent("a", "why", 1.7)
    for event in (wave, runner, abort):
        assert event_from_json(json.loads(json.dumps(event.to_json_dict()))) == event


def test_a_real_run_is_clean_online_and_offline(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    config = EngineConfig(
        pipeline="testing-noise",
        device="cpu",
        execution_mode="step",
        max_num_seqs=2,
        audit="report",
        trace_path=str(trace),
    )
    with DiffusionEngine.make_engine(config) as engine:
        outputs = engine.generate(["a", "b", "c"], SamplingParams(num_inference_steps=3))
        assert all(o.ok for o in outputs)
        auditor = engine.auditor
    assert auditor is not None and auditor.violations == []
    assert audit_events(read_trace(trace)) == []


def test_a_broken_scheduler_is_flagged_online_and_offline(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    [mutation] = [m for m in CATALOGUE if m.name == "wave-over-capacity"]
    config = EngineConfig(
        pipeline="testing-noise",
        device="cpu",
        execution_mode="step",
        max_num_seqs=2,
        audit="report",
        trace_path=str(trace),
        warmup=False,
    )
    with mutation.patch(), DiffusionEngine.make_engine(config) as engine:
        engine.generate(["a", "b", "c"], SamplingParams(num_inference_steps=3))
        auditor = engine.auditor
    assert auditor is not None
    assert "INV-007" in {v.invariant for v in auditor.violations}
    offline = audit_events(read_trace(trace))
    assert "INV-007" in {v.invariant for v in offline}

    out = tmp_path / "trace.json"
    assert main(["audit", str(trace), "--perfetto", str(out)]) == 1
    document = json.loads(out.read_text())
    records = document["traceEvents"]
    names = {r["args"]["name"] for r in records if r["ph"] == "M" and "args" in r}
    assert {"requests", "waves"} <= names
    assert any(r["ph"] == "X" and r["name"] == "RUNNING" for r in records)
    assert any(r["ph"] == "X" and r["name"].startswith("wave ") for r in records)
    assert any(r["ph"] == "i" and r["name"] == "INV-007 violated" for r in records)


def test_the_export_of_an_empty_trace_is_a_valid_document() -> None:
    document = chrome_trace([])
    assert document["traceEvents"] and all(r["ph"] == "M" for r in document["traceEvents"])


def test_the_audit_benchmark_reports_its_ratios_and_the_checkers_cost_at_a_tiny_size() -> None:
    from diffusion_runtime.bench.audit import run

    results = run(batch_sizes=(2,), steps=2, repeats=1, mode="step")
    batch = results["batches"]["2"]
    variants = {"off", "off_twin", "audited", "traced"}
    assert set(batch["best_cpu_s"]) == set(batch["best_wall_s"]) == variants
    for name in ("off_twin", "audited", "traced"):
        assert batch[f"{name}_throughput_vs_off"] > 0
        assert batch[f"{name}_wall_throughput_vs_off"] > 0
    assert batch["checkers_us_per_step"] > 0 and 0 < batch["checkers_share_of_step"] < 1
