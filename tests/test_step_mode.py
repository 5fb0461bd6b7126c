"""Step mode: continuous batching, progress, streaming, aborts at step boundaries, cleanup."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import engine_threads, factory_of

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    EngineDeadError,
    PipelineContractError,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from diffusion_runtime.contracts import RunnerOutput
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestMachine
from diffusion_runtime.scheduler import Request
from diffusion_runtime.scheduler.step_scheduler import StepScheduler
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline

S = RequestStatus
Build = Callable[..., DiffusionEngine]


def steps(n: int, seed: int = 0, **extra: Any) -> SamplingParams:
    return SamplingParams(num_inference_steps=n, seed=seed, **extra)


async def collect(engine: DiffusionEngine, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.stream(rid)]


def step_engine(make_engine: Build, pipeline: Any, **overrides: Any) -> DiffusionEngine:
    overrides.setdefault("max_num_seqs", 4)
    engine = make_engine(factory_of(pipeline), execution_mode="step", **overrides)
    pipeline.step_batches.clear()
    return engine


@pytest.mark.parametrize("pipeline_name", ["testing-noise", "digits"])
def test_step_mode_output_equals_request_mode_output(
    make_engine: Build, pipeline_name: str
) -> None:
    prompts = ["1", "7", "7", "3"]
    params = [steps(n, seed=s) for n, s in [(3, 1), (5, 2), (8, 2), (5, 9)]]
    by_request = make_engine(pipeline_name, max_num_seqs=4).generate(prompts, params)
    by_step = make_engine(pipeline_name, max_num_seqs=4, execution_mode="step").generate(
        prompts, params
    )
    for a, b in zip(by_request, by_step, strict=True):
        assert a.ok and b.ok
        assert torch.equal(a.image_batch, b.image_batch)
        assert (b.step, b.num_steps) == (b.num_steps, b.num_steps)


def test_mixed_step_counts_share_steps_and_leave_when_done(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults)
    outs = engine.generate(["a", "b", "c"], [steps(2), steps(4), steps(3)])
    a, b, c = (o.request_id for o in outs)
    assert all(o.ok for o in outs)
    assert faults.step_batches == [[a, b, c], [a, b, c], [b, c], [b]]


def test_requests_join_between_steps_up_to_capacity(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults, max_num_seqs=2)

    async def scenario() -> list[list[RequestOutput]]:
        first = await engine.add_request("gate", steps(3))
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        # Queued while step 1 of "first" runs: both join at the next boundary, one at a time.
        second = await engine.add_request("b", steps(2))
        third = await engine.add_request("c", steps(1))
        faults.gate_release.set()
        return [await collect(engine, rid) for rid in (first, second, third)]

    results = asyncio.run(scenario())
    first, second, third = (r[-1].request_id for r in results)
    assert all(r[-1].ok for r in results)
    assert faults.step_batches == [[first], [first, second], [first, second], [third]]


def test_incompatible_request_waits_for_the_running_set_to_drain(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults)
    outs = engine.generate(["a", "b", "c"], [steps(2), steps(1, height=8, width=8), steps(1)])
    a, b, c = (o.request_id for o in outs)
    assert faults.step_batches == [[a], [a], [b], [c]]
    assert [tuple(o.image_batch.shape[-2:]) for o in outs] == [(16, 16), (8, 8), (16, 16)]


def test_streaming_sends_progress_then_previews_then_the_final_output(make_engine: Build) -> None:
    engine = make_engine("digits", streaming_output=True, preview_interval=2)

    async def scenario() -> list[RequestOutput]:
        rid = await engine.add_request("4", steps(5))
        return await collect(engine, rid)

    outs = asyncio.run(scenario())
    assert [(o.step, o.num_steps, o.finished) for o in outs] == [
        (1, 5, False),
        (2, 5, False),
        (3, 5, False),
        (4, 5, False),
        (5, 5, True),
    ]
    assert [o.status for o in outs] == [S.RUNNING] * 4 + [S.FINISHED_COMPLETED]
    assert [o.image_batch is not None for o in outs] == [False, True, False, True, True]
    assert outs[1].image_batch is not None and outs[1].image_batch.shape == (1, 1, 8, 8)


def test_progress_reaches_the_stream_without_previews(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults, streaming_output=True)

    async def scenario() -> list[RequestOutput]:
        return await collect(engine, await engine.add_request("p", steps(3)))

    outs = asyncio.run(scenario())
    assert [(o.step, o.finished, o.image_batch is None) for o in outs] == [
        (1, False, True),
        (2, False, True),
        (3, True, False),
    ]


def test_abort_takes_effect_at_the_next_step_boundary_and_frees_state(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults)

    async def scenario() -> tuple[list[RequestOutput], list[RequestOutput]]:
        victim = await engine.add_request("gate", steps(50))
        other = await engine.add_request("other", steps(3))
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        engine.abort(victim)
        faults.gate_release.set()
        return await collect(engine, victim), await collect(engine, other)

    victim, other = asyncio.run(scenario())
    assert [o.status for o in victim] == [S.FINISHED_ABORTED]
    assert other[-1].ok
    victim_id = victim[0].request_id
    # The step that was running when the abort came was its last.
    assert sum(victim_id in batch for batch in faults.step_batches) == 1
    snapshot = engine.snapshot()
    assert not snapshot.runner_cached_ids and not snapshot.scheduler_ids


def test_consumer_that_stops_reading_aborts_between_steps(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults, streaming_output=True)

    async def scenario() -> str:
        rid = await engine.add_request("long", steps(200))
        async for out in engine.stream(rid):
            assert out.step == 1
            break  # stop reading after the first progress output
        return rid

    rid = asyncio.run(scenario())
    faults.step_batches.clear()
    engine.generate(["sync point"], steps(1))
    assert all(rid not in batch for batch in faults.step_batches[1:])
    snapshot = engine.snapshot()
    assert rid not in snapshot.runner_cached_ids and rid not in snapshot.scheduler_ids


def test_a_failing_scheduler_step_fails_only_its_request(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults)
    outs = engine.generate(["ok", "bad-step", "fine"], [steps(3), steps(3), steps(2)])
    assert [o.status for o in outs] == [
        S.FINISHED_COMPLETED,
        S.FINISHED_ERROR,
        S.FINISHED_COMPLETED,
    ]
    assert outs[1].error == "ValueError: injected step failure"
    assert not engine.snapshot().runner_cached_ids


def test_a_failing_denoise_step_fails_the_requests_in_that_step(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults, max_num_seqs=2)
    outs = engine.generate(["a", "fail", "c"], steps(2))
    assert [o.status for o in outs] == [S.FINISHED_ERROR, S.FINISHED_ERROR, S.FINISHED_COMPLETED]
    assert outs[0].error == "RuntimeError: injected failure"
    assert not engine.snapshot().runner_cached_ids


def test_a_batched_step_that_leaves_a_request_behind_fails_and_drops_it_at_once() -> None:
    """``step_batch`` fails one request alone by leaving its step index in place:
    the runner fails it and drops its state in that step, not at the next output."""
    config = EngineConfig(
        pipeline="testing-faults",
        pipeline_kwargs={"batched_steps": True},
        device="cpu",
        execution_mode="step",
        max_num_seqs=2,
    )
    core = EngineCore(config)
    try:
        core.add_request("ok", "ok", steps(3), seed=0)
        core.add_request("bad", "bad-step", steps(3), seed=0)
        [failed] = [out for out in core.step().outputs if out.finished]
        assert failed.request_id == "bad" and failed.status is S.FINISHED_ERROR
        assert failed.error == "the pipeline's step moved the step index from 0 to 0 (of 3)"
        assert core.snapshot().runner_cached_ids == {"ok"}
        finals = []
        while core.has_unfinished():
            finals += [out for out in core.step().outputs if out.finished]
        assert [(out.request_id, out.status) for out in finals] == [("ok", S.FINISHED_COMPLETED)]
    finally:
        core.shutdown()


def test_runner_state_is_released_on_every_terminal_path(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults, max_num_seqs=8)

    async def scenario() -> list[RequestOutput]:
        gate = await engine.add_request("gate", steps(4))
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        ids = [
            await engine.add_request(prompt, steps(3))
            for prompt in (
                "completes",
                "bad-step",
                "aborted while running",
                "aborted while waiting",
            )
        ]
        faults.gate_release.set()
        await asyncio.sleep(0)
        engine.abort(ids[2:])
        return [(await collect(engine, rid))[-1] for rid in [gate, *ids]]

    finals = asyncio.run(scenario())
    assert {o.status for o in finals} <= {
        S.FINISHED_COMPLETED,
        S.FINISHED_ERROR,
        S.FINISHED_ABORTED,
    }
    assert finals[2].status is S.FINISHED_ERROR
    snapshot = engine.snapshot()
    assert (
        not snapshot.runner_cached_ids and not snapshot.scheduler_ids and not snapshot.running_ids
    )


def test_close_and_device_fault_release_everything(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = step_engine(make_engine, faults)
    with pytest.raises(EngineDeadError):
        engine.generate(["a", "device-fault"], steps(3))
    assert not engine.snapshot().scheduler_ids
    engine.close()
    assert engine_threads() == []


def test_step_mode_needs_a_step_pipeline() -> None:
    with pytest.raises(
        PipelineContractError, match="NullPipeline lacks prepare_encode, denoise_step"
    ):
        DiffusionEngine.make_engine(
            EngineConfig(pipeline="testing-null", device="cpu", execution_mode="step")
        )
    with pytest.raises(PipelineContractError):
        DiffusionEngine.make_engine(
            EngineConfig(pipeline="testing-null", device="cpu", streaming_output=True)
        )
    assert engine_threads() == []


def _running_request(scheduler: StepScheduler, rid: str, n: int) -> Any:
    params = steps(n)
    scheduler.add_request(Request(rid, rid, params, 0, scheduler.batch_key_for(params)))
    output = scheduler.schedule(now=0.0)
    assert output is not None
    return output


@pytest.mark.parametrize(
    ("progress", "message"),
    [
        ({}, "no step index"),
        ({"r": (0, 3)}, "step 0 of 3 after step 0"),
        ({"r": (4, 3)}, "step 4 of 3"),
    ],
)
def test_scheduler_fails_a_request_with_bad_progress(
    progress: dict[str, tuple[int, int]], message: str
) -> None:
    scheduler = StepScheduler(RequestMachine(), EngineConfig(execution_mode="step"))
    output = _running_request(scheduler, "r", 3)
    events: list[Any] = []
    scheduler.machine.subscribe(events.append)
    scheduler.update_from_output(output, RunnerOutput(output.wave_id, progress=progress))
    assert events[-1].dest is S.FINISHED_ERROR
    assert message in events[-1].reason


def test_scheduler_completes_only_with_images_at_the_last_step() -> None:
    scheduler = StepScheduler(RequestMachine(), EngineConfig(execution_mode="step"))
    output = _running_request(scheduler, "r", 2)
    scheduler.update_from_output(output, RunnerOutput(output.wave_id, progress={"r": (1, 2)}))
    assert scheduler.running["r"].step_index == 1
    nxt = scheduler.schedule(now=0.0)
    assert nxt is not None and nxt.scheduled_cached_ids == ("r",) and not nxt.scheduled_new_reqs
    request = scheduler.running["r"]
    scheduler.update_from_output(nxt, RunnerOutput(nxt.wave_id, progress={"r": (2, 2)}))
    assert request.state is S.FINISHED_ERROR


def test_input_batch_forgets_released_states_at_once() -> None:
    from diffusion_runtime.pipelines.protocols import PipelineRequest, StepRequestState
    from diffusion_runtime.runner.input_batch import InputBatch

    request = PipelineRequest("r", "p", steps(1), 0, torch.device("cpu"))
    state = StepRequestState(request, torch.zeros(1), [1])
    batch = InputBatch()
    assert batch.update(("r",), {"r": state})
    batch.cache["stacked"] = torch.zeros(4)
    assert not batch.update(("r",), {"r": state}), "unchanged: reused"
    batch.invalidate()
    assert len(batch) == 0 and batch.cache == {} and batch.request_ids == ()
