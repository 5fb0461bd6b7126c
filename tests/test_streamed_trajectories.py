"""Trajectories streamed with progress outputs (``SamplingParams.stream_trajectory``,
``docs/outputs.md``), on the digits pipeline with stochastic DDIM steps.

Each progress output carries the part of the trajectory recorded since the one
before it; joined, the parts are the final trajectory's first steps bit for bit,
and the final output is the same bits as a run that streams nothing: in process,
on mp, through the stage, and for a request preempted and resumed."""

from __future__ import annotations

import asyncio

import attrs
import pytest
import torch

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput, Trajectory
from diffusion_runtime.stage.client import StageClient

STEPS = 6
STREAMED = SamplingParams(
    num_inference_steps=STEPS,
    seed=21,
    guidance_scale=2.0,
    num_outputs_per_prompt=2,
    extra_args={"eta": 0.9},
    return_trajectory="full",
    stream_trajectory=True,
)
#: A batch mate that asks for a trajectory without streaming it.
QUIET = SamplingParams(
    num_inference_steps=4, seed=8, extra_args={"eta": 0.5}, return_trajectory="latents"
)


def config(**fields: object) -> EngineConfig:
    fields.setdefault("warmup", False)
    fields.setdefault("execution_mode", "step")
    return EngineConfig(pipeline="digits", device="cpu", **fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def unstreamed() -> dict[str, RequestOutput]:
    """The same requests on an engine that streams nothing (``stream_trajectory`` off)."""
    with DiffusionEngine.make_engine(config()) as engine:
        [streamed] = engine.generate(["3"], attrs.evolve(STREAMED, stream_trajectory=False))
        [quiet] = engine.generate(["5"], QUIET)
    return {"streamed": streamed, "quiet": quiet}


def assert_same_trajectory(mine: Trajectory, theirs: Trajectory) -> None:
    assert torch.equal(mine.latents, theirs.latents)
    assert mine.timesteps == theirs.timesteps
    assert mine.log_prob_steps == theirs.log_prob_steps
    assert mine.first_step == theirs.first_step
    if mine.log_probs is None or theirs.log_probs is None:
        assert mine.log_probs is None and theirs.log_probs is None
    else:
        assert torch.equal(mine.log_probs, theirs.log_probs)


def check_stream(outputs: list[RequestOutput], expected: RequestOutput) -> None:
    """One part per progress output, each starting where the one before ended; the
    parts and what the final adds join to the final trajectory, which equals
    ``expected``'s, as do the images."""
    *progress, final = outputs
    assert final.finished and final.ok, final
    assert [o.step for o in progress] == list(range(1, STEPS))
    parts = [o.trajectory for o in progress]
    assert all(part is not None for part in parts)
    steps = [(p.first_step, p.end_step) for p in parts if p is not None]
    assert steps == [(i, i + 1) for i in range(STEPS - 1)]
    assert final.trajectory is not None and expected.trajectory is not None
    assert_same_trajectory(final.trajectory, expected.trajectory)
    assert final.image_batch is not None and expected.image_batch is not None
    assert torch.equal(final.image_batch, expected.image_batch)
    streamed = Trajectory.join([p for p in parts if p is not None])
    # The parts are the final trajectory's first STEPS - 1 steps, bit for bit...
    whole = final.trajectory
    assert torch.equal(streamed.latents, whole.latents[:STEPS])
    assert streamed.timesteps == whole.timesteps[: STEPS - 1]
    assert streamed.log_probs is not None and whole.log_probs is not None
    assert torch.equal(streamed.log_probs, whole.log_probs[: len(streamed.log_prob_steps)])
    # ... and with what the final output adds after them, the whole of it.
    assert_same_trajectory(Trajectory.join([streamed, whole.steps_from(STEPS - 1)]), whole)
    # Each part holds only its own steps: the first starts with the initial noise.
    first = parts[0]
    assert first is not None and first.latents.shape == (2, 2, 64)
    assert torch.equal(first.latents[0], whole.latents[0])


def run_core(core: EngineCore) -> dict[str, list[RequestOutput]]:
    by_id: dict[str, list[RequestOutput]] = {}
    try:
        while core.has_unfinished():
            for output in core.step().outputs:
                by_id.setdefault(output.request_id, []).append(output)
    finally:
        core.shutdown()
    return by_id


def test_progress_outputs_carry_the_new_part_in_process(
    unstreamed: dict[str, RequestOutput],
) -> None:
    """The in-process engine's stream; a batch mate that does not stream its
    trajectory gets its progress without any and its whole trajectory at the end."""
    engine = DiffusionEngine.make_engine(config(streaming_output=True, audit="raise"))

    async def scenario() -> tuple[list[RequestOutput], list[RequestOutput]]:
        streamed = await engine.add_request("3", STREAMED)
        quiet = await engine.add_request("5", QUIET)
        return [o async for o in engine.stream(streamed)], [o async for o in engine.stream(quiet)]

    with engine:
        streamed, quiet = asyncio.run(scenario())
    check_stream(streamed, unstreamed["streamed"])
    *progress, final = quiet
    assert progress and all(o.trajectory is None for o in progress)
    assert final.trajectory is not None and unstreamed["quiet"].trajectory is not None
    assert_same_trajectory(final.trajectory, unstreamed["quiet"].trajectory)


def test_progress_outputs_carry_the_new_part_on_mp(unstreamed: dict[str, RequestOutput]) -> None:
    core = EngineCore(config(streaming_output=True, executor_backend="mp", audit="raise"))
    core.add_request("streamed", "3", STREAMED, seed=21)
    core.add_request("quiet", "5", QUIET, seed=8)
    outputs = run_core(core)
    check_stream(outputs["streamed"], unstreamed["streamed"])
    assert all(o.trajectory is None for o in outputs["quiet"][:-1])


def test_progress_outputs_carry_the_new_part_through_the_stage(
    unstreamed: dict[str, RequestOutput],
) -> None:
    async def scenario() -> list[RequestOutput]:
        async with StageClient(config(streaming_output=True)) as client:
            request_id = await client.add_request("3", STREAMED)
            return [o async for o in client.stream(request_id)]

    check_stream(asyncio.run(scenario()), unstreamed["streamed"])


def test_a_preempted_request_streams_a_consistent_trajectory(
    unstreamed: dict[str, RequestOutput],
) -> None:
    """Preempted after two steps by a higher-priority request (its state offloaded to
    host memory), then resumed: no part is lost or repeated across the pause."""
    core = EngineCore(
        config(
            streaming_output=True,
            scheduling_policy="priority",
            max_num_seqs=1,
            preempted_offload_bytes=2**30,
            audit="raise",
        )
    )
    core.add_request("low", "3", attrs.evolve(STREAMED, priority=5), seed=21)
    early = core.step().outputs + core.step().outputs
    core.add_request("high", "9", SamplingParams(num_inference_steps=3, seed=2), seed=2)
    preempted = False
    outputs = list(early)
    try:
        while core.has_unfinished():
            outputs += core.step().outputs
            low = core.scheduler.requests.get("low")
            preempted |= low is not None and low.state is RequestStatus.PREEMPTED
    finally:
        core.shutdown()
    assert preempted
    check_stream([o for o in outputs if o.request_id == "low"], unstreamed["streamed"])


def test_streaming_a_trajectory_is_refused_by_field_where_it_cannot_stream() -> None:
    with pytest.raises(InvalidFieldError, match="stream_trajectory needs return_trajectory"):
        SamplingParams(stream_trajectory=True)
    with pytest.raises(InvalidFieldError, match="stream_trajectory must be a bool"):
        SamplingParams(return_trajectory="full", stream_trajectory=1)  # type: ignore[arg-type]
    for quiet in (config(execution_mode="request"), config()):
        with DiffusionEngine.make_engine(quiet) as engine:
            with pytest.raises(InvalidFieldError) as refused:
                engine.generate(["3"], STREAMED)
            assert refused.value.field == "stream_trajectory"
            assert "EngineConfig.streaming_output=True" in str(refused.value)
    with DiffusionEngine.make_engine(config(streaming_output=True)) as engine:
        with pytest.raises(InvalidFieldError, match="stream_trajectory is for a single request"):
            engine.generate(["3", "4"], STREAMED, group=True)
        assert engine.snapshot().scheduler_ids == frozenset()
        [output] = engine.generate(["3"], STREAMED)
        assert output.ok and output.trajectory is not None


def test_parts_join_only_in_order() -> None:
    whole = Trajectory(
        latents=torch.arange(5.0).reshape(5, 1, 1),
        timesteps=(9, 7, 5, 3),
        log_probs=torch.tensor([[0.5], [1.5]], dtype=torch.float64),
        log_prob_steps=(1, 2),
    )
    assert whole.steps_from(0) is whole
    tail = whole.steps_from(2)
    assert tail.first_step == 2 and tail.timesteps == (5, 3) and tail.log_prob_steps == (2,)
    assert tail.latents.flatten().tolist() == [3.0, 4.0]
    assert tail.log_probs is not None and tail.log_probs.flatten().tolist() == [1.5]
    assert whole.steps_from(3).log_probs is None
    head = Trajectory(whole.latents[:3], (9, 7), whole.log_probs[:1], (1,))  # type: ignore[index]
    assert_same_trajectory(Trajectory.join([head, tail]), whole)
    with pytest.raises(ValueError, match="cannot follow"):
        Trajectory.join([whole, tail])
    with pytest.raises(ValueError, match="outside"):
        whole.steps_from(5)
