"""The request-mode scheduler against the real request machine, without an engine.

Every scheduler here runs on a virtual clock moved by binary fractions of a
second, so sums of readings are exact and a wakeup falls exactly on a reading.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_runtime import DuplicateRequestError, EngineConfig, QueueFullError, SamplingParams
from diffusion_runtime.contracts import RunnerOutput
from diffusion_runtime.fsm import LifecycleViolation, RequestMachine, RequestStatus
from diffusion_runtime.scheduler import BaseScheduler, Request, RequestScheduler, StepScheduler
from diffusion_runtime.testing.virtual_clock import VirtualClock

pytestmark = pytest.mark.usefixtures("monotonic_offset")

S = RequestStatus
#: About a millisecond, as a binary fraction.
TICK = 2.0**-10
#: The coalescing tests' ``request_batch_max_wait_ms``: 1/8 s, so its stable
#: window (half of it) is 1/16 s, both binary fractions.
MAX_WAIT_MS = 125.0
MAX_WAIT_S = MAX_WAIT_MS / 1000
STABLE_S = MAX_WAIT_S / 2


def make(
    max_num_seqs: int = 4, clock: VirtualClock | None = None, **config: object
) -> RequestScheduler:
    machine: RequestMachine[Request] = RequestMachine()
    scheduler = RequestScheduler(machine, EngineConfig(max_num_seqs=max_num_seqs, **config))  # type: ignore[arg-type]
    scheduler.clock = VirtualClock() if clock is None else clock
    return scheduler


def add(scheduler: BaseScheduler, rid: str, steps: int = 4, **params: object) -> Request:
    """Admit a request that arrives now on the scheduler's (virtual) clock."""
    p = SamplingParams(num_inference_steps=steps, **params)  # type: ignore[arg-type]
    request = Request(
        rid, rid, p, seed=0, batch_key=scheduler.batch_key_for(p), arrival_time=scheduler.clock()
    )
    scheduler.add_request(request)
    return request


def test_waves_are_fifo_compatible_and_capped() -> None:
    scheduler = make(max_num_seqs=2)
    for rid, steps in [("a", 4), ("b", 4), ("c", 4), ("d", 8), ("e", 4)]:
        add(scheduler, rid, steps)
    waves = []
    while scheduler.waiting:
        out = scheduler.schedule(now=0.0)
        assert out is not None
        waves.append(list(out.scheduled_ids))
        images = {rid: torch.zeros(1, 1, 1, 1) for rid in out.scheduled_ids}
        scheduler.update_from_output(out, RunnerOutput(out.wave_id, images))
    # The wave stops at the first incompatible request: no reordering around "d".
    assert waves == [["a", "b"], ["c"], ["d"], ["e"]]
    assert not scheduler.requests and not scheduler.running


def test_every_scheduled_request_terminates_on_update() -> None:
    scheduler = make()
    reqs = [add(scheduler, rid) for rid in "abcd"]
    out = scheduler.schedule(now=0.0)
    assert out is not None and out.scheduled_ids == ("a", "b", "c", "d")
    assert all(r.state is S.RUNNING for r in reqs)
    result = RunnerOutput(
        out.wave_id,
        images={"a": torch.zeros(1, 1, 2, 2), "d": torch.zeros(0, 1, 2, 2)},
        errors={"b": "RuntimeError: boom"},
    )
    scheduler.update_from_output(out, result)
    assert [r.state for r in reqs] == [
        S.FINISHED_COMPLETED,
        S.FINISHED_ERROR,  # the runner's error
        S.FINISHED_ERROR,  # missing result
        S.FINISHED_ERROR,  # empty result
    ]
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    # In request mode a worker holds nothing once its wave is done: no release-only output.
    assert not scheduler.has_pending_release()
    assert scheduler.schedule(now=0.0) is None


def test_abort_while_waiting_and_while_running() -> None:
    scheduler = make(max_num_seqs=1)
    a, b = add(scheduler, "a"), add(scheduler, "b")
    out = scheduler.schedule(now=0.0)
    assert out is not None and out.scheduled_ids == ("a",)
    assert scheduler.abort_request("a", "caller") and scheduler.abort_request("b", "caller")
    assert a.state is b.state is S.FINISHED_ABORTED
    assert not scheduler.abort_request("a", "again"), "a finished request ignores aborts"
    assert not scheduler.abort_request("nope", "unknown")
    # The aborted request's late result is dropped, not applied.
    scheduler.update_from_output(out, RunnerOutput(out.wave_id, {"a": torch.zeros(1, 1, 1, 1)}))
    assert a.state is S.FINISHED_ABORTED
    # Request mode: the workers hold nothing for "a" after its wave, so nothing is sent.
    assert scheduler.schedule(now=0.0) is None


def test_step_mode_reports_finished_ids_of_requests_the_workers_saw() -> None:
    machine: RequestMachine[Request] = RequestMachine()
    scheduler = StepScheduler(machine, EngineConfig(max_num_seqs=1, execution_mode="step"))
    scheduler.clock = VirtualClock()
    add(scheduler, "a")
    add(scheduler, "b")
    out = scheduler.schedule(now=0.0)
    assert out is not None and out.scheduled_ids == ("a",)
    assert scheduler.abort_request("a", "caller") and scheduler.abort_request("b", "caller")
    nxt = scheduler.schedule(now=0.0)
    # Only "a" reached the workers, so only "a" is reported finished to them.
    assert nxt is not None and nxt.finished_ids == ("a",) and not nxt.has_work


def test_duplicate_active_ids_are_rejected_but_ids_can_be_reused_after_finish() -> None:
    scheduler = make()
    first = add(scheduler, "x")
    with pytest.raises(DuplicateRequestError, match="'x'"):
        add(scheduler, "x")
    assert scheduler.requests["x"] is first and len(scheduler.waiting) == 1
    scheduler.abort_request("x", "done")
    add(scheduler, "x")
    assert scheduler.num_waiting == 1


def test_a_finished_request_object_added_again_is_refused_and_leaves_nothing() -> None:
    scheduler = make()
    first = add(scheduler, "x")
    scheduler.abort_request("x", "done")
    with pytest.raises(LifecycleViolation, match="'x'"):
        scheduler.add_request(first)
    assert not scheduler.requests and not scheduler.waiting
    assert scheduler.schedule(now=0.0) is None


def test_queue_bound() -> None:
    scheduler = make(max_waiting_requests=2)
    add(scheduler, "a")
    add(scheduler, "b")
    with pytest.raises(QueueFullError):
        add(scheduler, "c")
    assert "c" not in scheduler.requests


def test_preempted_request_goes_back_to_the_head() -> None:
    scheduler = make(max_num_seqs=1)
    add(scheduler, "a")
    add(scheduler, "b")
    out = scheduler.schedule(now=0.0)
    assert out is not None and out.scheduled_ids == ("a",)
    scheduler.preempt_request("a")
    assert list(scheduler.waiting) == ["a", "b"] and not scheduler.running
    out = scheduler.schedule(now=0.0)
    assert out is not None and out.scheduled_ids == ("a",)


def test_admission_coalescing_waits_for_a_fuller_wave_until_the_deadline() -> None:
    clock = VirtualClock()
    scheduler = make(max_num_seqs=4, clock=clock, request_batch_max_wait_ms=MAX_WAIT_MS)
    t0 = add(scheduler, "a").arrival_time
    clock.advance(TICK)
    assert scheduler.schedule(now=clock()) is None
    # It first looked a tick after "a" arrived: quiet for the stable window from then.
    assert scheduler.next_wakeup() == t0 + TICK + STABLE_S
    clock.advance(TICK)
    b = add(scheduler, "b")
    clock.advance(TICK)
    assert scheduler.schedule(now=clock()) is None
    assert scheduler.next_wakeup() == b.arrival_time + STABLE_S
    # Quiet for the stable window (min(0.3 s, max wait / 2)) after "b": run what we have.
    clock.advance(STABLE_S - TICK)
    out = scheduler.schedule(now=clock())
    assert out is not None and out.scheduled_ids == ("a", "b")


def test_admission_coalescing_fires_at_once_when_the_wave_is_full() -> None:
    scheduler = make(max_num_seqs=2, request_batch_max_wait_ms=1000.0)
    a = add(scheduler, "a")
    add(scheduler, "b")
    out = scheduler.schedule(now=a.arrival_time)
    assert out is not None and out.scheduled_ids == ("a", "b")


def test_admission_coalescing_deadline_caps_the_wait() -> None:
    clock = VirtualClock()
    scheduler = make(max_num_seqs=8, clock=clock, request_batch_max_wait_ms=MAX_WAIT_MS)
    t0 = add(scheduler, "a").arrival_time
    assert scheduler.schedule(now=t0) is None  # the engine is idle: it looks at once
    # Arrivals every 3/64 s never leave the queue quiet for the 1/16 s window...
    for rid in "bc":
        clock.advance(3 * 2.0**-6)
        add(scheduler, rid)
    clock.advance(MAX_WAIT_S - 6 * 2.0**-6 - TICK)
    assert scheduler.schedule(now=clock()) is None
    assert scheduler.next_wakeup() == t0 + MAX_WAIT_S
    # ...so the oldest request's 1/8 s deadline is what ends the wait.
    clock.advance(TICK)
    assert clock() == t0 + MAX_WAIT_S
    out = scheduler.schedule(now=clock())
    assert out is not None and out.scheduled_ids == ("a", "b", "c")


def test_time_behind_another_wave_does_not_use_up_the_coalescing_window() -> None:
    """Requests that waited through a busy engine still wait for company once it
    is free: clients that resubmit on every answer would otherwise split into
    groups whose waves alternate."""
    clock = VirtualClock()
    scheduler = make(max_num_seqs=8, clock=clock, request_batch_max_wait_ms=MAX_WAIT_MS)
    t0 = add(scheduler, "a").arrival_time
    add(scheduler, "b")
    # The engine first looks 1/2 s later (another wave ran): a fresh window starts.
    clock.advance(0.5)
    assert scheduler.schedule(now=clock()) is None
    assert scheduler.next_wakeup() == t0 + 0.5 + STABLE_S  # quiet for the window from then
    clock.advance(2.0**-5)
    add(scheduler, "c")  # the other group's request comes back
    clock.advance(TICK)
    assert scheduler.schedule(now=clock()) is None
    wake = t0 + 0.5 + 2.0**-5 + STABLE_S  # before the fresh window's deadline, at 5/8 s
    assert scheduler.next_wakeup() == wake
    clock.advance(wake - clock())
    out = scheduler.schedule(now=clock())
    assert out is not None and out.scheduled_ids == ("a", "b", "c")
    # The next wave's window starts afresh.
    d = add(scheduler, "d")
    assert scheduler.schedule(now=d.arrival_time) is None
    assert scheduler.next_wakeup() == d.arrival_time + STABLE_S
