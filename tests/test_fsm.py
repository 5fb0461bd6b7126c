from __future__ import annotations

import itertools

import pytest

from diffusion_runtime.fsm import (
    ENTRY_HOOKS,
    TERMINAL_STATES,
    TRANSITION_TABLE,
    Hook,
    LifecycleEvent,
    LifecycleViolation,
    RequestLifecycle,
    RequestMachine,
    RequestStatus,
    Trigger,
)

S = RequestStatus


def machine_with_log() -> tuple[RequestMachine[RequestLifecycle], list[LifecycleEvent]]:
    machine: RequestMachine[RequestLifecycle] = RequestMachine()
    events: list[LifecycleEvent] = []
    machine.subscribe(events.append)
    return machine, events


def admitted(machine: RequestMachine[RequestLifecycle], rid: str = "r") -> RequestLifecycle:
    request = RequestLifecycle(rid)
    machine.admit(request)
    return request


def test_table_covers_every_state_and_terminal_states_have_no_exit() -> None:
    assert set(ENTRY_HOOKS) == set(RequestStatus)
    for sources, _dest in TRANSITION_TABLE.values():
        assert not TERMINAL_STATES & set(sources)
    reachable = {dest for _, dest in TRANSITION_TABLE.values()}
    assert reachable == set(RequestStatus) - {S.WAITING}


@pytest.mark.parametrize(
    ("path", "final"),
    [
        ([Trigger.SCHEDULE, Trigger.COMPLETE], S.FINISHED_COMPLETED),
        ([Trigger.ABORT], S.FINISHED_ABORTED),
        ([Trigger.SCHEDULE, Trigger.ABORT], S.FINISHED_ABORTED),
        ([Trigger.SCHEDULE, Trigger.FAIL], S.FINISHED_ERROR),
        ([Trigger.FAIL], S.FINISHED_ERROR),
        (
            [Trigger.SCHEDULE, Trigger.PREEMPT, Trigger.SCHEDULE, Trigger.COMPLETE],
            S.FINISHED_COMPLETED,
        ),
        ([Trigger.SCHEDULE, Trigger.PREEMPT, Trigger.ABORT], S.FINISHED_ABORTED),
    ],
)
def test_paths_emit_one_event_per_transition(path: list[Trigger], final: RequestStatus) -> None:
    machine, events = machine_with_log()
    request = admitted(machine)
    for wave, trigger in enumerate(path):
        machine.fire(request, trigger, wave_id=wave)
    assert request.state is final
    assert [e.trigger for e in events] == ["admit"] + [t.value for t in path]
    assert [e.wave_id for e in events[1:]] == list(range(len(path)))
    assert events[0].source is None and events[0].dest is S.WAITING
    for before, after in itertools.pairwise(events):
        assert after.source is before.dest
        assert after.time >= before.time
    assert events[-1].dest is final


@pytest.mark.parametrize("second", list(Trigger))
@pytest.mark.parametrize("first_terminal", [Trigger.COMPLETE, Trigger.ABORT, Trigger.FAIL])
def test_terminal_states_accept_nothing(first_terminal: Trigger, second: Trigger) -> None:
    machine, events = machine_with_log()
    request = admitted(machine, "req-7")
    machine.fire(request, Trigger.SCHEDULE)
    machine.fire(request, first_terminal)
    final = request.state
    with pytest.raises(LifecycleViolation) as info:
        machine.fire(request, second, reason="late")
    assert info.value.request_id == "req-7"
    assert info.value.state is final
    assert info.value.trigger == second.value
    assert "req-7" in str(info.value) and final.value in str(info.value)
    assert request.state is final, "the first terminal status wins"
    assert events[-1].rejected and events[-1].trigger == second.value
    assert events[-1].dest is final


def test_caller_abort_after_finish_is_a_no_op() -> None:
    machine, events = machine_with_log()
    request = admitted(machine)
    machine.fire(request, Trigger.SCHEDULE)
    machine.fire(request, Trigger.COMPLETE)
    before = len(events)
    assert machine.abort_if_active(request, "late caller") is None
    assert request.state is S.FINISHED_COMPLETED
    assert len(events) == before
    live = admitted(machine, "live")
    assert machine.abort_if_active(live, "caller") is not None
    assert live.state is S.FINISHED_ABORTED and events[-1].reason == "caller"


def test_illegal_non_terminal_moves_are_violations() -> None:
    machine, _ = machine_with_log()
    request = admitted(machine)
    for trigger in (Trigger.COMPLETE, Trigger.PREEMPT):
        with pytest.raises(LifecycleViolation):
            machine.fire(request, trigger)
    machine.fire(request, Trigger.SCHEDULE)
    with pytest.raises(LifecycleViolation):
        machine.fire(request, Trigger.SCHEDULE)
    assert request.state is S.RUNNING


def test_admitting_twice_is_a_violation() -> None:
    machine, _ = machine_with_log()
    request = admitted(machine)
    machine.fire(request, Trigger.SCHEDULE)
    with pytest.raises(LifecycleViolation):
        machine.admit(request)


def test_hooks_run_per_entered_state_and_all_run_when_one_raises() -> None:
    machine, _ = machine_with_log()
    seen: list[tuple[str, str, str]] = []

    def record(hook: Hook) -> object:
        return lambda r, e: seen.append((hook.value, r.request_id, e.dest.value))

    def broken(request: RequestLifecycle, event: LifecycleEvent) -> None:
        raise ValueError("hook bug")

    for hook in Hook:
        machine.add_hook(hook, record(hook))  # type: ignore[arg-type]
    machine.add_hook(Hook.TERMINAL, broken)
    machine.add_hook(Hook.TERMINAL, lambda r, e: seen.append(("after-broken", r.request_id, "")))
    request = admitted(machine, "a")
    machine.fire(request, Trigger.SCHEDULE)
    machine.fire(request, Trigger.PREEMPT)
    machine.fire(request, Trigger.SCHEDULE)
    with pytest.raises(ValueError, match="hook bug"):
        machine.fire(request, Trigger.COMPLETE)
    assert seen == [
        ("admitted", "a", "WAITING"),
        ("scheduled", "a", "RUNNING"),
        ("preempted", "a", "PREEMPTED"),
        ("scheduled", "a", "RUNNING"),
        ("terminal", "a", "FINISHED_COMPLETED"),
        ("after-broken", "a", ""),
    ]
    assert request.state is S.FINISHED_COMPLETED


def test_events_serialise_to_json_dicts() -> None:
    machine, events = machine_with_log()
    request = admitted(machine, "j")
    machine.fire(request, Trigger.FAIL, reason="boom")
    record = events[-1].to_json_dict()
    assert record["request_id"] == "j"
    assert record["source"] == "WAITING" and record["dest"] == "FINISHED_ERROR"
    assert record["reason"] == "boom" and record["rejected"] is False


def test_the_live_machine_matches_the_table() -> None:
    moves = RequestMachine().legal_moves()
    expected = [
        (source, trigger, dest)
        for trigger, (sources, dest) in TRANSITION_TABLE.items()
        for source in sources
    ]
    assert sorted(moves) == sorted(expected)


def test_docs_diagram_is_generated_from_the_machine() -> None:
    from pathlib import Path

    from diffusion_runtime.fsm.diagram import mermaid_state_diagram

    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    assert "```mermaid\n" + mermaid_state_diagram() + "```" in doc, (
        "docs/architecture.md is stale: paste `python -m diffusion_runtime.fsm.diagram`"
    )


def test_auditor_memory_of_finished_requests_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_runtime.fsm import audit, violation

    monkeypatch.setattr(violation, "RECENT_LIMIT", 3)
    machine, _ = machine_with_log()
    auditor = audit.Auditor()
    machine.subscribe(auditor.feed)
    for i in range(10):
        request = admitted(machine, f"r{i}")
        machine.fire(request, Trigger.ABORT)
    owner = auditor.checkers[0]
    assert isinstance(owner, audit.OneLifecycleOwner)
    assert list(owner.closed) == ["r7", "r8", "r9"] and not owner.open
    assert auditor.violations == []
