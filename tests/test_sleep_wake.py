"""Sleep and wake: exact restore, requests that wait, illegal orders, memory released.

Real engines with real pipelines (digits and the testing pipelines), in process
and with worker processes; the only fakes are injected faults.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from conftest import device_memory_in_use, factory_of, suite_device, suite_device_index

from diffusion_runtime import (
    DiffusionEngine,
    EngineClosedError,
    EngineConfig,
    EngineState,
    PipelineContractError,
    RequestStatus,
    RPCError,
    SamplingParams,
    SleepStateError,
)
from diffusion_runtime.core import EngineCore
from diffusion_runtime.errors import EngineDeadError, InvalidFieldError
from diffusion_runtime.fsm.audit import audit_events
from diffusion_runtime.fsm.events import EngineEvent, TraceEvent, WaveEvent
from diffusion_runtime.fsm.trace import read_trace
from diffusion_runtime.pipelines.digits.pipeline import DigitsPipeline
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.runner.sleep import WorkerSleep
from diffusion_runtime.runner.weights import device_weight_bytes, weight_modules
from diffusion_runtime.stage import StageClient
from diffusion_runtime.testing.core_harness import core_lifecycle_machine
from diffusion_runtime.testing.mutations import passes
from diffusion_runtime.testing.pipelines import SeededNoisePipeline

PARAMS = (
    SamplingParams(num_inference_steps=4, seed=11),
    SamplingParams(num_inference_steps=6, seed=12, guidance_scale=2.0),
    SamplingParams(num_inference_steps=3, seed=13, num_outputs_per_prompt=2),
)
PROMPTS = ["3", "7", "1"]


def on_cuda() -> bool:
    """``--device cuda``: the engines of the device tests here run on the GPU."""
    return suite_device() == "cuda"


def config(pipeline: Any = "digits", **overrides: Any) -> EngineConfig:
    overrides.setdefault("device", suite_device())
    overrides.setdefault("warmup", False)
    return EngineConfig(pipeline=pipeline, **overrides)


def images(outputs: Sequence[Any]) -> list[torch.Tensor]:
    assert all(output.ok for output in outputs), [output.error for output in outputs]
    return [output.image_batch for output in outputs]


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# -- exact restore -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize(
    ("pipeline", "backend"),
    [("digits", "uni"), ("digits", "mp"), ("testing-noise", "uni"), ("testing-faults", "uni")],
)
def test_outputs_after_wake_are_bit_identical_at_both_levels(
    pipeline: str, backend: str, mode: str
) -> None:
    events: list[TraceEvent] = []
    cfg = config(pipeline, execution_mode=mode, executor_backend=backend, audit="raise")
    with DiffusionEngine.make_engine(cfg) as engine:
        engine.machine.subscribe(events.append)
        before = images(engine.generate(PROMPTS, list(PARAMS)))
        held = engine.collective_rpc("device_weight_bytes")
        for level in (1, 2):
            engine.sleep(level)
            assert engine.is_sleeping and engine.state is EngineState.SLEEPING
            if level == 2:
                assert engine.collective_rpc("device_weight_bytes") == [0]
            engine.wake_up()
            assert engine.collective_rpc("device_weight_bytes") == held
            assert not engine.is_sleeping and engine.state is EngineState.SERVING
            assert_identical(before, images(engine.generate(PROMPTS, list(PARAMS))))
    states = [e.state for e in events if isinstance(e, EngineEvent)]
    assert states[:4] == ["sleeping", "awake"] * 2
    assert engine.auditor is not None and not engine.auditor.violations


@pytest.mark.parametrize("level", [1, 2])
def test_a_step_mode_request_running_at_sleep_resumes_where_it_stopped(level: int) -> None:
    """Sleep between two steps of a running request: no step runs while asleep, the
    request stays running (never cut short), and its image equals an unslept run."""
    params = SamplingParams(num_inference_steps=8, seed=3, guidance_scale=1.5)
    reference = EngineCore(config(execution_mode="step"))
    try:
        reference.add_request("r", "5", params, params.seed or 0)
        expected = run_to_end(reference)["r"]
    finally:
        reference.shutdown()
    events: list[TraceEvent] = []
    core = EngineCore(config(execution_mode="step"))
    try:
        core.add_request("r", "5", params, params.seed or 0)
        for _ in range(3):
            assert core.step().executed
        core.sleep(level)
        core.machine.subscribe(events.append)
        for _ in range(3):
            result = core.step()
            assert not result.executed and result.outputs == [] and result.wake_at is None
        assert core.scheduler.running.keys() == {"r"}
        assert core.snapshot().runner_cached_ids == {"r"}
        assert not [e for e in events if isinstance(e, WaveEvent)]  # no wave while asleep
        core.wake_up()
        assert torch.equal(run_to_end(core)["r"], expected)
    finally:
        core.shutdown()


def run_to_end(core: EngineCore) -> dict[str, torch.Tensor]:
    finals: dict[str, torch.Tensor] = {}
    while core.has_unfinished():
        for output in core.step().outputs:
            if output.finished:
                assert output.ok, output.error
                finals[output.request_id] = output.image_batch
    return finals


def test_an_abort_while_asleep_ends_a_running_request_and_frees_its_state() -> None:
    params = SamplingParams(num_inference_steps=6, seed=1)
    core = EngineCore(config(execution_mode="step"))
    try:
        core.add_request("r", "2", params, 1)
        core.step()
        core.sleep(2)
        core.abort(["r"])
        [output] = core.step().outputs
        assert output.status is RequestStatus.FINISHED_ABORTED
        snapshot = core.snapshot()
        assert not snapshot.scheduler_ids and not snapshot.runner_cached_ids
        core.wake_up()
        assert not core.has_unfinished()
    finally:
        core.shutdown()


# -- requests while asleep ------------------------------------------------------------


def test_a_recorded_trace_of_a_sleep_audits_clean_and_a_wave_while_asleep_is_inv_012(
    tmp_path: Path,
) -> None:
    """The trace of an abort while asleep (its release wave runs nothing) audits clean;
    the same trace with a wave of the running request moved inside the sleep does not."""
    trace = tmp_path / "sleep.jsonl"
    params = SamplingParams(num_inference_steps=4, seed=2)
    core = EngineCore(config(execution_mode="step", trace_path=str(trace)))
    try:
        core.add_request("kept", "3", params, 2)
        core.add_request("aborted", "4", params, 3)
        core.step()
        core.sleep(2)
        core.abort(["aborted"])
        core.step()
        core.wake_up()
        run_to_end(core)
    finally:
        core.shutdown()
    events = list(read_trace(trace))
    assert audit_events(events) == []
    states = [e.state if isinstance(e, EngineEvent) else None for e in events]
    asleep = states.index("sleeping")
    first_wave_after = next(
        i
        for i, e in enumerate(events)
        if i > asleep and isinstance(e, WaveEvent) and e.scheduled_ids
    )
    wave = events.pop(first_wave_after)
    assert isinstance(wave, WaveEvent)
    events.insert(asleep + 1, wave)  # the wave now comes between sleeping and awake
    [violation] = [v for v in audit_events(events) if v.invariant == "INV-012"]
    assert f"wave {wave.wave_id} scheduled ['kept']" in violation.message


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_requests_that_arrive_while_asleep_wait_and_complete_after_wake(backend: str) -> None:
    with DiffusionEngine.make_engine(config(executor_backend=backend)) as engine:
        expected = images(engine.generate(PROMPTS, list(PARAMS)))
        engine.sleep(2)
        results: list[Any] = []
        caller = threading.Thread(
            target=lambda: results.append(engine.generate(PROMPTS, list(PARAMS)))
        )
        caller.start()
        caller.join(0.5)
        assert caller.is_alive() and engine.queue_length == len(PROMPTS)
        engine.wake_up()
        caller.join(60)
        assert not caller.is_alive()
        assert_identical(expected, images(results[0]))


def test_generate_with_a_timeout_times_out_while_asleep_and_leaves_nothing_behind(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("digits")
    engine.sleep(1)
    with pytest.raises(TimeoutError):
        engine.generate(PROMPTS, list(PARAMS), timeout=0.2)
    snapshot = engine.snapshot()
    assert not snapshot.scheduler_ids and snapshot.waiting == 0
    assert engine.is_sleeping
    engine.wake_up()
    assert len(images(engine.generate(PROMPTS, list(PARAMS)))) == len(PROMPTS)


# -- illegal orders -------------------------------------------------------------------


def test_illegal_orders_raise_named_errors(make_engine: Callable[..., DiffusionEngine]) -> None:
    engine = make_engine("digits")
    with pytest.raises(SleepStateError, match="awake"):
        engine.wake_up()
    with pytest.raises(InvalidFieldError, match=r"sleep\.level must be 1 or 2; got 3"):
        engine.sleep(3)
    engine.sleep(1)
    with pytest.raises(SleepStateError, match="already asleep"):
        engine.sleep(2)
    with pytest.raises(RPCError, match="reserved"):
        engine.collective_rpc("wake_device")
    engine.wake_up()
    engine.close()
    assert engine.state is EngineState.SHUT_DOWN
    with pytest.raises(EngineClosedError):
        engine.sleep(1)
    with pytest.raises(EngineClosedError):
        engine.wake_up()


def test_a_core_shut_down_while_asleep_refuses_to_wake() -> None:
    core = EngineCore(config(execution_mode="step"))
    core.add_request("r", "4", PARAMS[0], 1)
    core.step()
    core.sleep(2)
    [output] = core.shutdown()
    assert output.status is RequestStatus.FINISHED_ABORTED
    with pytest.raises(EngineDeadError):
        core.wake_up()


# -- memory and the level-2 contract --------------------------------------------------


def test_level_2_releases_the_weight_storage_and_wake_restores_it(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    """In process; the bit-identity test checks level 2 with worker processes too."""
    engine = make_engine("digits", device=suite_device())
    [held] = engine.collective_rpc("device_weight_bytes")
    assert held > 1_000_000  # the digits network: ~1.3M float parameters
    engine.sleep(2)
    assert engine.collective_rpc("device_weight_bytes") == [0]
    engine.wake_up()
    assert engine.collective_rpc("device_weight_bytes") == [held]
    engine.sleep(1)  # on the CPU, host memory is the device: nothing to free
    assert engine.collective_rpc("device_weight_bytes") == [0 if on_cuda() else held]
    engine.wake_up()
    assert engine.collective_rpc("device_weight_bytes") == [held]


def test_level_1_keeps_every_parameter_object_and_level_2_reloads_from_the_file() -> None:
    device = torch.device(suite_device_index())
    pipeline = DigitsPipeline(device)
    sleeper = WorkerSleep(pipeline, idle_runner(device), device)
    params = {name: p for name, p in pipeline.model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    sleeper.sleep(1)
    sleeper.wake_up()
    assert all(p is params[name] for name, p in pipeline.model.named_parameters())
    sleeper.sleep(2)
    assert all(p.is_meta for p in pipeline.model.parameters())
    assert device_weight_bytes(pipeline, device) == 0
    sleeper.wake_up()
    for name, p in pipeline.model.named_parameters():
        assert p.device == device and torch.equal(p, values[name])


@pytest.mark.parametrize("level", [1, 2])
def test_on_cuda_sleep_returns_device_memory_to_the_pre_load_baseline(level: int) -> None:
    """``--device cuda`` only: the tensors the process holds on the device while
    asleep are within 5% of the weights above what it held before the engine."""
    if not on_cuda():
        pytest.skip("a CUDA check: run with --device cuda")
    baseline, _ = device_memory_in_use()
    with DiffusionEngine.make_engine(config(execution_mode="step")) as engine:
        engine.generate(PROMPTS, list(PARAMS))
        loaded, _ = device_memory_in_use()
        engine.sleep(level)
        asleep, in_use = device_memory_in_use()
        print(f"level {level}: tensors {baseline} -> {loaded} -> {asleep} B; {in_use} B in use")
        assert asleep - baseline <= 0.05 * (loaded - baseline)
        engine.wake_up()
        assert device_memory_in_use()[0] >= loaded - (loaded - baseline) // 20


def idle_runner(device: torch.device) -> ModelRunner:
    """A real runner with no requests, for driving a WorkerSleep alone."""
    return ModelRunner(SeededNoisePipeline(device), device, step_mode=True)


class WeightedNoisePipeline(SeededNoisePipeline):
    """The noise pipeline with a real weight (a scale the output passes through)."""

    def __init__(self, device: torch.device | str = "cpu", reload_dtype: Any = None) -> None:
        super().__init__(device)
        self.scale = self._build()
        self.reload_dtype = reload_dtype

    def _build(self) -> torch.nn.Linear:
        torch.manual_seed(0)
        return torch.nn.Linear(1, 1).to(self.device)

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        out = super().forward(batch)
        weight = self.scale.weight.reshape(())
        return {rid: images * weight for rid, images in out.items()}


class ReloadingPipeline(WeightedNoisePipeline):
    def reload_weights(self) -> None:
        self.scale = self._build()
        if self.reload_dtype is not None:  # an injected fault: the wrong dtype
            self.scale = self.scale.to(self.reload_dtype)


def test_level_2_is_refused_for_a_pipeline_with_weights_but_no_reload(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine(factory_of(WeightedNoisePipeline()))
    with pytest.raises(PipelineContractError, match="reload_weights"):
        engine.sleep(2)
    assert engine.state is EngineState.SERVING
    engine.sleep(1)
    engine.wake_up()
    assert len(images(engine.generate(["a"], PARAMS[0]))) == 1


def test_a_reload_into_the_wrong_dtype_fails_the_wake_and_the_engine_stays_asleep(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    pipeline = ReloadingPipeline(reload_dtype=torch.float64)
    engine = make_engine(factory_of(pipeline))
    expected = images(engine.generate(["a"], PARAMS[0]))
    engine.sleep(2)
    with pytest.raises(PipelineContractError, match=r"scale\.weight.*float64"):
        engine.wake_up()
    assert engine.is_sleeping
    pipeline.reload_dtype = None
    engine.wake_up()
    assert_identical(expected, images(engine.generate(["a"], PARAMS[0])))


def test_the_default_walk_finds_modules_through_plain_objects_and_containers() -> None:
    class Holder:
        def __init__(self) -> None:
            self.parts = {"unet": torch.nn.Linear(2, 2), "more": [torch.nn.Conv2d(1, 1, 1)]}
            self.shared = self.parts["unet"]
            self.fn = print

    class Outer:
        def __init__(self) -> None:
            self.family = Holder()
            self.latent = torch.zeros(3)  # a loose tensor is not a weight

    assert sorted(weight_modules(Outer())) == ["family.parts.more.0", "family.parts.unet"]


# -- the stage ------------------------------------------------------------------------


def test_the_stage_sleeps_wakes_and_profiles_through_its_own_messages(tmp_path: Path) -> None:
    """Sleep, wake and profile are stage messages (not RPCs: the core must know),
    their errors cross with their own classes, and a request sent while the stage
    sleeps waits and completes after the wake, identical to one before."""

    async def scenario() -> None:
        async with StageClient(config(profile_dir=str(tmp_path))) as client:
            [before] = await client.generate(["6"], PARAMS[1])
            with pytest.raises(SleepStateError):
                await client.wake_up()
            with pytest.raises(RPCError, match="allow-list"):
                await client.collective_rpc("sleep_device", [1])
            await client.sleep(2)
            assert client.is_sleeping
            assert await client.collective_rpc("device_weight_bytes") == [0]
            waiting = asyncio.ensure_future(client.generate(["6"], PARAMS[1]))
            await asyncio.sleep(0.5)
            assert not waiting.done() and await client.queue_length() == 1
            paths = await client.start_profile("stage")
            await client.wake_up()
            [after] = await waiting
            assert await client.stop_profile() == paths
            assert_identical(images([before]), images([after]))
            assert "aten::linear" in Path(paths[0]).read_text()

    asyncio.run(scenario())


@pytest.mark.parametrize(("level", "offload_bytes"), [(1, 0), (2, 1 << 20)])
def test_a_request_preempted_at_sleep_resumes_bit_identical(level: int, offload_bytes: int) -> None:
    """Priority preemption leaves a request's step state on the workers (or in host
    memory within ``preempted_offload_bytes``); it survives the sleep unchanged."""
    low = SamplingParams(num_inference_steps=8, priority=5, guidance_scale=2.0)
    high = SamplingParams(num_inference_steps=3)
    solo: dict[str, torch.Tensor] = {}
    for name, prompt, params in (("low", "8", low), ("high", "0", high)):
        alone = EngineCore(config(execution_mode="step"))
        try:
            alone.add_request(name, prompt, params, 21)
            solo.update(run_to_end(alone))
        finally:
            alone.shutdown()
    core = EngineCore(
        config(
            execution_mode="step",
            scheduling_policy="priority",
            max_num_seqs=1,
            preempted_offload_bytes=offload_bytes,
            audit="raise",
        )
    )
    try:
        core.add_request("low", "8", low, 21)
        core.step()
        core.step()
        core.add_request("high", "0", high, 21)
        core.step()  # "high" runs; "low" is preempted, its state kept
        assert core.scheduler.requests["low"].state is RequestStatus.PREEMPTED
        core.sleep(level)
        core.step()
        core.wake_up()
        finals = run_to_end(core)
    finally:
        core.shutdown()
    assert finals.keys() == solo.keys()
    for name, image in finals.items():
        assert torch.equal(image, solo[name])


# -- diffusers ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_diffusers_pipeline_loaded_from_a_directory_reloads_it_at_level_2(
    models: Any, tmp_path: Path, mode: str, make_engine: Callable[..., DiffusionEngine]
) -> None:
    models.dit_pipeline().save_pretrained(tmp_path)
    engine = make_engine("diffusers", pipeline_kwargs={"path": str(tmp_path)}, execution_mode=mode)
    params = SamplingParams(num_inference_steps=3, seed=4, guidance_scale=2.0)
    before = images(engine.generate([1, 7], params))
    [held] = engine.collective_rpc("device_weight_bytes")
    engine.sleep(2)
    assert engine.collective_rpc("device_weight_bytes") == [0]
    engine.wake_up()
    assert engine.collective_rpc("device_weight_bytes") == [held]
    assert_identical(before, images(engine.generate([1, 7], params)))


def test_a_diffusers_pipeline_without_a_source_sleeps_at_level_1_only(
    models: Any, make_engine: Callable[..., DiffusionEngine]
) -> None:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    engine = make_engine(factory_of(DiffusersPipeline(models.dit_pipeline())))
    with pytest.raises(PipelineContractError, match="reload_weights"):
        engine.sleep(2)
    engine.sleep(1)
    engine.wake_up()


def test_the_core_harness_accepts_a_refused_level_2_and_sleeps_at_level_1() -> None:
    """A pipeline with weights and no ``reload_weights`` must refuse level 2: the
    harness's sleep rule takes the refusal (the core stays awake) and sleeps at level 1."""
    machine = core_lifecycle_machine(
        lambda: EngineConfig(pipeline=WeightedNoisePipeline, device="cpu", warmup=False),
        prompts=st.sampled_from(["a", "b"]),
    )
    passes(machine, max_examples=40)
    reach = machine.reach
    assert reach.counts["path: level 2 refused (no reload_weights)"] > 0, reach.table()
    assert reach.counts["rule: sleep at level 1"] > 0, reach.table()
