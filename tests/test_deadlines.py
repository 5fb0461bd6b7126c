"""The core's clock: on a virtual clock, arrival, deadlines, the deadline drop, the
step cost model and request timings follow that clock exactly, through the real
engine core and the digits pipeline with the auditor attached."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from diffusion_runtime import EngineConfig, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import DEADLINE_REASON, RequestStatus
from diffusion_runtime.fsm.events import TraceEvent, WaveEvent
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.testing.virtual_clock import VirtualClock

pytestmark = pytest.mark.usefixtures("monotonic_offset")

TICK = 2.0**-8
BLOCKER = SamplingParams(num_inference_steps=6)
DUE_IN_4_TICKS = SamplingParams(num_inference_steps=2, deadline_s=4 * TICK)


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(start=1.0)


def open_core(clock: VirtualClock, miss: str) -> EngineCore:
    config = EngineConfig(
        pipeline="digits",
        device="cpu",
        execution_mode="step",
        max_num_seqs=1,
        warmup=False,
        audit="raise",
        deadline_miss=miss,
    )
    return EngineCore(config, clock=clock)


@pytest.fixture(params=["drop", "run_late"])
def core(request: pytest.FixtureRequest, clock: VirtualClock) -> Iterator[EngineCore]:
    core = open_core(clock, request.param)
    yield core
    core.shutdown()
    assert core.auditor is not None and core.auditor.violations == []


def finals(outputs: list[RequestOutput]) -> dict[str, RequestOutput]:
    return {o.request_id: o for o in outputs if o.finished}


def test_a_request_waiting_at_its_deadline_is_dropped_exactly_then_or_runs_late(
    core: EngineCore, clock: VirtualClock
) -> None:
    core.add_request("blocker", "1", BLOCKER, seed=0)
    core.add_request("due", "2", DUE_IN_4_TICKS, seed=0)
    core.step()  # the blocker runs; "due" waits behind it (one request at a time)
    assert core.scheduler.requests["due"].deadline == 1.0 + 4 * TICK
    clock.advance(4 * TICK - 2.0**-20)
    assert "due" not in finals(core.step().outputs), "dropped before its deadline"
    clock.advance(2.0**-20)  # exactly the deadline
    ended = finals(core.step().outputs)
    if core.config.deadline_miss == "drop":
        assert ended["due"].status is RequestStatus.FINISHED_ABORTED
        assert ended["due"].error == DEADLINE_REASON
        assert ended["due"].metrics.total_time_s == ended["due"].metrics.queue_time_s == 4 * TICK
    else:
        assert "due" not in ended
        while core.has_unfinished():
            ended.update(finals(core.step().outputs))
        assert ended["due"].ok and ended["due"].metrics.queue_time_s == 4 * TICK


def test_waves_and_request_timings_follow_the_core_clock(
    core: EngineCore, clock: VirtualClock
) -> None:
    core.add_request("a", "3", BLOCKER, seed=0)

    def three_ticks_a_wave(event: TraceEvent) -> None:
        if isinstance(event, WaveEvent):  # published once the wave is chosen, before it runs
            clock.advance(3 * TICK)

    core.machine.subscribe(three_ticks_a_wave)
    outputs: list[RequestOutput] = []
    while core.has_unfinished():
        outputs += core.step().outputs
    key = BLOCKER.step_batch_key()
    assert core.scheduler.step_costs.seconds_per_step(key) == 3 * TICK
    metrics = finals(outputs)["a"].metrics
    assert metrics.queue_time_s == 0.0
    assert metrics.execution_time_s == metrics.total_time_s == 6 * 3 * TICK


def test_a_virtual_clock_never_goes_back() -> None:
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        VirtualClock().advance(-TICK)
