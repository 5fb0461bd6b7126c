"""Several prompts in one request, in process (``docs/outputs.md``, "Grouped requests"):
``add_request(prompts=[...])`` and ``generate(prompts, params, group=True)``.

The parent's one output merges what each prompt gives run alone, bit for bit, on
the real digits pipeline over the uni and mp executors; aborting the parent
aborts every child, a failing child fails the parent and aborts the rest, the
parent ends exactly once, and the engine holds nothing of either afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import factory_of

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.errors import DuplicateRequestError, EngineClosedError
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent, RequestStatus
from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.outputs import STAGES, RequestMetrics, RequestOutput
from diffusion_runtime.request_groups import MAX_GROUP_PROMPTS, merge_metrics
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline

S = RequestStatus
#: Two images per prompt, stochastic steps, the full trajectory.
RL = SamplingParams(
    num_inference_steps=4,
    seed=7,
    num_outputs_per_prompt=2,
    extra_args={"eta": 0.8},
    return_trajectory="full",
)
LATENT = SamplingParams(num_inference_steps=3, seed=2, output_type="latent")
FAST = SamplingParams(num_inference_steps=1, seed=0)


@pytest.fixture(scope="module", params=["uni", "mp"])
def digits(request: pytest.FixtureRequest) -> Iterator[DiffusionEngine]:
    config = EngineConfig(
        pipeline="digits", device="cpu", warmup=False, executor_backend=request.param
    )
    with DiffusionEngine.make_engine(config) as engine:
        yield engine


def assert_nothing_left(engine: DiffusionEngine) -> None:
    """No parent, child, stream or runner state is held once every request ended."""
    snapshot = engine.snapshot()
    assert not snapshot.group_ids, snapshot
    assert not snapshot.scheduler_ids and not snapshot.running_ids, snapshot
    assert not snapshot.runner_cached_ids and not snapshot.unclaimed_stream_ids, snapshot
    assert engine.queue_length == 0


def terminal_states(events: list[TraceEvent]) -> dict[str, list[RequestStatus]]:
    ends: dict[str, list[RequestStatus]] = {}
    for event in events:
        if isinstance(event, LifecycleEvent) and event.dest in TERMINAL_STATES:
            ends.setdefault(event.request_id, []).append(event.dest)
    return ends


def recording(
    machine_subscribe: Callable[[Callable[[TraceEvent], None]], None],
) -> list[TraceEvent]:
    events: list[TraceEvent] = []
    machine_subscribe(events.append)
    return events


def test_a_grouped_request_merges_each_prompt_run_alone_bit_for_bit(
    digits: DiffusionEngine,
) -> None:
    prompts = ["3", 7, "1"]
    parent = digits.generate(prompts, RL, group=True)
    alone = digits.generate(prompts, RL)
    assert parent.ok and parent.finished and parent.seed == 7 and parent.error is None
    assert parent.image_batch is not None and parent.image_batch.shape == (6, 1, 8, 8)
    trajectory = parent.trajectory
    assert trajectory is not None and trajectory.log_probs is not None
    assert trajectory.latents.shape[1] == 6 and trajectory.log_probs.shape[1] == 6
    for index, one in enumerate(alone):  # two images per prompt, in prompt order
        rows = slice(2 * index, 2 * index + 2)
        assert one.image_batch is not None and one.trajectory is not None
        assert torch.equal(parent.image_batch[rows], one.image_batch)
        assert torch.equal(trajectory.latents[:, rows], one.trajectory.latents)
        assert one.trajectory.log_probs is not None
        assert torch.equal(trajectory.log_probs[:, rows], one.trajectory.log_probs)
        assert trajectory.timesteps == one.trajectory.timesteps
        assert trajectory.log_prob_steps == one.trajectory.log_prob_steps
    metrics = parent.metrics
    assert metrics is not None
    assert metrics.queue_time_s + metrics.execution_time_s == pytest.approx(metrics.total_time_s)
    assert tuple(metrics.stage_durations) == STAGES and metrics.stage_durations["denoise"] > 0
    assert metrics.stage_durations["queue"] == metrics.queue_time_s
    assert metrics.peak_memory_mb is not None and metrics.peak_memory_mb > 0

    latent = digits.generate(["4", "5"], LATENT, group=True)
    latent_alone = digits.generate(["4", "5"], LATENT)
    assert latent.image_batch is None and latent.latents is not None
    assert torch.equal(latent.latents, torch.cat([o.latents for o in latent_alone]))  # type: ignore[misc]
    assert_nothing_left(digits)


def test_a_parents_metrics_take_the_first_start_the_last_end_and_the_highest_peak() -> None:
    def child(queue: float, total: float, denoise: float, peak: float | None) -> RequestMetrics:
        stages = {"queue": queue, "encode": 0.0, "denoise": denoise, "decode": 0.0}
        return RequestMetrics(queue, total - queue, total, {**stages, "transfer": 0.0}, peak)

    merged = merge_metrics([child(0.25, 1.0, 0.5, 300.0), child(0.5, 2.0, 1.25, None), None])
    assert merged is not None
    assert (merged.queue_time_s, merged.execution_time_s, merged.total_time_s) == (0.25, 1.75, 2.0)
    assert merged.stage_durations == {
        "queue": 0.25, "encode": 0.0, "denoise": 1.25, "decode": 0.0, "transfer": 0.0
    }  # fmt: skip
    assert merged.peak_memory_mb == 300.0
    assert merge_metrics([None, None]) is None


def test_add_request_with_prompts_streams_one_final_output(digits: DiffusionEngine) -> None:
    children = recording(digits.machine.subscribe)
    unseeded = SamplingParams(num_inference_steps=3)

    async def scenario() -> list[RequestOutput]:
        rid = await digits.add_request(prompts=["2", "2"], params=unseeded, request_id="g")
        assert rid == "g"
        return [o async for o in digits.stream(rid)]

    try:
        outputs = asyncio.run(scenario())
    finally:
        digits.machine.unsubscribe(children.append)
    [parent] = outputs  # no progress: the final output only
    assert parent.request_id == "g" and parent.ok and parent.image_batch is not None
    assert torch.equal(parent.image_batch[0], parent.image_batch[1])  # one seed for all
    again = digits.generate(["2"], SamplingParams(num_inference_steps=3, seed=parent.seed))[0]
    assert again.image_batch is not None and torch.equal(again.image_batch[0], parent.images[0])
    assert terminal_states(children) == {
        "g/0": [S.FINISHED_COMPLETED],
        "g/1": [S.FINISHED_COMPLETED],
    }
    assert_nothing_left(digits)


def test_aborting_the_parent_aborts_every_child(faults: FaultInjectingPipeline) -> None:
    config = EngineConfig(pipeline=factory_of(faults), device="cpu", max_num_seqs=1)
    with DiffusionEngine.make_engine(config) as engine:
        children = recording(engine.machine.subscribe)
        parents = recording(engine.groups.machine.subscribe)

        async def scenario() -> list[RequestOutput]:
            rid = await engine.add_request(prompts=["gate", "b", "c"], params=FAST, request_id="g")
            assert await asyncio.to_thread(faults.gate_entered.wait, 10)  # child 0 runs
            engine.abort("g", "enough")
            engine.abort("g", "twice")  # the parent has ended: ignored
            faults.gate_release.set()
            return [o async for o in engine.stream(rid)]

        [parent] = asyncio.run(scenario())
        assert parent.status is S.FINISHED_ABORTED and parent.error == "enough"
        assert parent.image_batch is None
        assert terminal_states(children) == {f"g/{i}": [S.FINISHED_ABORTED] for i in range(3)}
        assert terminal_states(parents) == {"g": [S.FINISHED_ABORTED]}
        assert_nothing_left(engine)


def test_a_failing_child_fails_the_parent_and_aborts_the_rest(
    faults: FaultInjectingPipeline,
) -> None:
    config = EngineConfig(pipeline=factory_of(faults), device="cpu", max_num_seqs=1)
    with DiffusionEngine.make_engine(config) as engine:
        children = recording(engine.machine.subscribe)
        parents = recording(engine.groups.machine.subscribe)
        parent = engine.generate(["a", "fail", "c"], FAST, group=True)
        assert parent.status is S.FINISHED_ERROR and parent.image_batch is None
        assert parent.error is not None and parent.error.startswith("prompt 1: RuntimeError")
        [rid] = terminal_states(parents)
        assert terminal_states(parents) == {rid: [S.FINISHED_ERROR]}
        assert terminal_states(children) == {
            f"{rid}/0": [S.FINISHED_COMPLETED],
            f"{rid}/1": [S.FINISHED_ERROR],
            f"{rid}/2": [S.FINISHED_ABORTED],  # waiting when its sibling failed
        }
        assert_nothing_left(engine)


def test_a_parent_interrupted_or_closed_leaves_nothing(faults: FaultInjectingPipeline) -> None:
    config = EngineConfig(pipeline=factory_of(faults), device="cpu")
    with DiffusionEngine.make_engine(config) as engine:
        engine.pause()
        with pytest.raises(TimeoutError):
            engine.generate(["a", "b"], FAST, group=True, timeout=0.01)
        engine.resume()
        assert engine.generate(["c"], FAST)[0].ok  # and the timed-out group's aborts applied
        assert_nothing_left(engine)
        engine.pause()

        async def closed_while_held() -> None:
            rid = await engine.add_request(prompts=["a", "b"], params=FAST)
            reader = asyncio.ensure_future(anext(engine.stream(rid)))
            await asyncio.sleep(0)
            await asyncio.to_thread(engine.close)
            with pytest.raises(EngineClosedError):
                await reader

        asyncio.run(closed_while_held())
        assert engine.snapshot().group_ids == frozenset()


def test_bad_groups_are_refused_by_field_and_the_engine_serves_on() -> None:
    config = EngineConfig(pipeline="digits", device="cpu", warmup=False)
    with DiffusionEngine.make_engine(config) as engine:

        def refused(call: Callable[[], object], field: str, rule: str) -> None:
            with pytest.raises(InvalidFieldError, match=rule) as error:
                call()
            assert error.value.field == field

        too_many = ["1"] * (MAX_GROUP_PROMPTS + 1)
        refused(lambda: engine.generate([], FAST, group=True), "prompts", "must not be empty")
        refused(lambda: engine.generate(["1", "x"], FAST, group=True), "prompts[1]", "digit")
        refused(lambda: engine.generate(too_many, FAST, group=True), "prompts", "at most 256")
        refused(lambda: engine.generate("12", FAST, group=True), "prompts", "list or tuple")
        refused(lambda: engine.generate(["1"], [FAST], group=True), "params", "one SamplingParams")

        async def collisions() -> None:
            with pytest.raises(InvalidFieldError, match="not be given with prompt") as both:
                await engine.add_request("1", FAST, prompts=["2"])
            assert both.value.field == "prompts"
            engine.pause()
            taken = await engine.add_request("1", FAST, request_id="g/1")
            with pytest.raises(DuplicateRequestError, match="'g/1' is taken"):
                await engine.add_request(prompts=["1", "2"], params=FAST, request_id="g")
            group = await engine.add_request(prompts=["1", "2"], params=FAST, request_id="h")
            for rid in ("h", "h/0"):
                with pytest.raises(DuplicateRequestError, match=f"'{rid}' is taken"):
                    await engine.add_request("1", FAST, request_id=rid)
            engine.resume()
            assert [o async for o in engine.stream(taken)][-1].ok
            assert [o async for o in engine.stream(group)][-1].ok

        asyncio.run(collisions())
        assert engine.generate(["1", "2"], FAST, group=True).ok
        assert_nothing_left(engine)
