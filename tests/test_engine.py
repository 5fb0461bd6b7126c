"""The engine end to end, on real torch pipelines, in request mode with the uni executor."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import engine_threads, factory_of

from diffusion_runtime import (
    DiffusionEngine,
    DiffusionExecutor,
    DuplicateRequestError,
    EngineClosedError,
    EngineConfig,
    EngineDeadError,
    InvalidFieldError,
    RequestOutput,
    RequestStatus,
    RPCError,
    SamplingParams,
)
from diffusion_runtime.executor import UniProcExecutor
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline, SeededNoisePipeline

S = RequestStatus
Build = Callable[..., DiffusionEngine]
FAST = SamplingParams(num_inference_steps=3, seed=11)


def direct(prompt: Any, params: SamplingParams, seed: int) -> torch.Tensor:
    """What the pipeline produces for this request alone, called without the engine."""
    request = PipelineRequest("solo", prompt, params, seed, torch.device("cpu"))
    return SeededNoisePipeline("cpu").forward([request])["solo"]


async def collect(engine: DiffusionEngine, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.stream(rid)]


def test_generate_returns_one_output_per_prompt_equal_to_a_solo_run(make_engine: Build) -> None:
    engine = make_engine(max_num_seqs=4)
    prompts = ["cat", "dog", 7, "cat", "owl"]
    params = [
        SamplingParams(num_inference_steps=4, seed=s, num_outputs_per_prompt=1 + s % 2)
        for s in range(5)
    ]
    outputs = engine.generate(prompts, params)
    assert [o.status for o in outputs] == [S.FINISHED_COMPLETED] * 5
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.finished and out.ok and out.error is None
        assert out.seed == p.seed
        assert len(out.images) == p.num_outputs_per_prompt
        assert torch.equal(torch.stack(out.images), direct(prompt, p, p.seed))
        assert out.metrics is not None
        assert 0 <= out.metrics.queue_time_s <= out.metrics.total_time_s
        assert 0 <= out.metrics.execution_time_s <= out.metrics.total_time_s
    assert len({o.request_id for o in outputs}) == 5


def test_seed_is_assigned_and_reported_when_not_given(make_engine: Build) -> None:
    engine = make_engine()
    first, second = engine.generate(["a", "a"], SamplingParams(num_inference_steps=2))
    assert first.seed != second.seed
    again = engine.generate(["a"], SamplingParams(num_inference_steps=2, seed=first.seed))[0]
    assert torch.equal(torch.stack(again.images), torch.stack(first.images))


def test_compatible_requests_share_one_fused_forward(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=4)
    faults.forward_batches.clear()
    two_steps = SamplingParams(num_inference_steps=2, seed=1)
    five_steps = SamplingParams(num_inference_steps=5, seed=1)
    outs = engine.generate(
        ["a", "b", "c", "d", "e", "f"], [two_steps] * 3 + [five_steps] + [two_steps] * 2
    )
    assert all(o.ok for o in outs)
    ids = [o.request_id for o in outs]
    # FIFO waves that stop at the first incompatible request.
    assert faults.forward_batches == [ids[0:3], ids[3:4], ids[4:6]]


def test_single_request_path_when_the_pipeline_cannot_batch(make_engine: Build) -> None:
    pipeline = FaultInjectingPipeline("cpu", supports_request_batch=False)
    engine = make_engine(factory_of(pipeline), max_num_seqs=4)
    pipeline.forward_batches.clear()
    outs = engine.generate(["ok", "fail", "ok too"], FAST)
    assert [o.status for o in outs] == [
        S.FINISHED_COMPLETED,
        S.FINISHED_ERROR,
        S.FINISHED_COMPLETED,
    ]
    assert outs[1].error == "RuntimeError: injected failure" and outs[1].images == []
    assert [len(b) for b in pipeline.forward_batches] == [1, 1, 1]


def test_a_failing_fused_forward_fails_only_its_wave(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=2)
    outs = engine.generate(["a", "fail", "c", "d"], FAST)
    assert [o.status for o in outs] == [
        S.FINISHED_ERROR,
        S.FINISHED_ERROR,
        S.FINISHED_COMPLETED,
        S.FINISHED_COMPLETED,
    ]
    assert engine.generate(["e"], FAST)[0].ok
    engine.check_health()


def test_missing_result_is_an_error_for_that_request_only(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=4)
    outs = engine.generate(["a", "missing", "c"], FAST)
    assert [o.status for o in outs] == [
        S.FINISHED_COMPLETED,
        S.FINISHED_ERROR,
        S.FINISHED_COMPLETED,
    ]
    assert outs[1].error is not None and "no output" in outs[1].error


def test_abort_while_waiting_and_while_running(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=1)

    async def scenario() -> tuple[list[RequestOutput], list[RequestOutput], list[RequestOutput]]:
        running = await engine.add_request("gate", FAST)
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        waiting = await engine.add_request("w", FAST)
        after = await engine.add_request("after", FAST)
        engine.abort([running, waiting])
        faults.gate_release.set()
        return (
            await collect(engine, running),
            await collect(engine, waiting),
            await collect(engine, after),
        )

    running, waiting, after = asyncio.run(scenario())
    for outs in (running, waiting):
        assert len(outs) == 1 and outs[0].status is S.FINISHED_ABORTED
        assert outs[0].error == "aborted by the caller" and outs[0].images == []
    assert after[0].ok
    snapshot = engine.snapshot()
    assert not snapshot.scheduler_ids and not snapshot.unclaimed_stream_ids


def test_abort_of_unknown_or_finished_ids_is_harmless(make_engine: Build) -> None:
    engine = make_engine()
    out = engine.generate(["a"], FAST)[0]
    engine.abort([out.request_id, "never-seen"])
    assert engine.generate(["b"], FAST)[0].ok


def test_consumer_that_stops_reading_aborts_its_request(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=1)

    async def scenario() -> str:
        blocker = await engine.add_request("gate", FAST)
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        dropped = await engine.add_request("dropped", FAST)
        reader = engine.stream(dropped)
        task = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)  # let the reader start waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await reader.aclose()
        faults.gate_release.set()
        assert (await collect(engine, blocker))[0].ok
        return dropped

    dropped = asyncio.run(scenario())
    faults.forward_batches.clear()
    assert engine.generate(["x"], FAST)[0].ok
    assert all(dropped not in batch for batch in faults.forward_batches)
    assert not engine.snapshot().scheduler_ids


def test_duplicate_active_id_is_rejected_without_disturbing_the_original(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=1)

    async def scenario() -> list[RequestOutput]:
        await engine.add_request("gate", FAST, request_id="dup")
        with pytest.raises(DuplicateRequestError, match="'dup'"):
            await engine.add_request("other", FAST, request_id="dup")
        faults.gate_release.set()
        return await collect(engine, "dup")

    outs = asyncio.run(scenario())
    assert outs[0].ok and outs[0].request_id == "dup"


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        (["list"], FAST, "prompt"),
        ("big", SamplingParams(height=4096), "height"),
        ("x", "not params", "params"),
    ],
)
def test_bad_input_is_rejected_at_admission_and_costs_nothing_else(
    make_engine: Build, faults: FaultInjectingPipeline, prompt: Any, params: Any, field: str
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=2)

    async def scenario() -> list[RequestOutput]:
        good = await engine.add_request("gate", FAST)
        with pytest.raises(InvalidFieldError) as info:
            await engine.add_request(prompt, params)
        assert info.value.field == field
        faults.gate_release.set()
        return await collect(engine, good)

    assert asyncio.run(scenario())[0].ok
    snapshot = engine.snapshot()
    assert not snapshot.scheduler_ids and not snapshot.unclaimed_stream_ids


def test_bad_request_in_a_generate_batch_admits_nothing(make_engine: Build) -> None:
    engine = make_engine()
    with pytest.raises(InvalidFieldError):
        engine.generate(["ok", None, "ok"], FAST)
    with pytest.raises(InvalidFieldError, match="one per prompt"):
        engine.generate(["a", "b"], [FAST])
    assert engine.snapshot().scheduler_ids == frozenset()
    assert engine.generate(["ok"], FAST)[0].ok


def test_device_fault_kills_the_engine_for_every_waiting_caller(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=1)

    async def scenario() -> None:
        fatal = await engine.add_request("gate device-fault", FAST)
        waiting = await engine.add_request("w", FAST)
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        faults.gate_release.set()
        for rid in (fatal, waiting):
            with pytest.raises(EngineDeadError, match="device fault"):
                await collect(engine, rid)

    asyncio.run(scenario())
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.generate(["late"], FAST)
    assert not engine.snapshot().scheduler_ids


def test_blocking_generate_sees_engine_death(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=1)
    with pytest.raises(EngineDeadError):
        engine.generate(["a", "device-fault", "c"], FAST)


def test_close_is_idempotent_wakes_streams_and_rejects_new_work(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    engine = make_engine(factory_of(faults), max_num_seqs=1)

    async def scenario() -> tuple[list[RequestOutput], BaseException | None]:
        running = await engine.add_request("gate", FAST)
        waiting = await engine.add_request("w", FAST)
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        closer = threading.Thread(target=engine.close)
        closer.start()
        faults.gate_release.set()
        error: BaseException | None = None
        try:
            await collect(engine, waiting)
        except EngineClosedError as exc:
            error = exc
        await asyncio.to_thread(closer.join, 10)
        return await collect(engine, running), error

    running, error = asyncio.run(scenario())
    assert isinstance(error, EngineClosedError)
    assert running[0].ok, "the wave already running when close() came completes"
    engine.close()
    engine.close()
    assert engine.is_closed
    with pytest.raises(EngineClosedError):
        engine.generate(["x"], FAST)
    with pytest.raises(EngineClosedError):
        engine.collective_rpc("device_name")
    assert engine_threads() == []


class Probe:
    """A worker extension: its public methods become RPC methods."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def pipeline_class(self) -> str:
        return type(self.worker.pipeline).__name__


def test_collective_rpc_allow_list_and_extensions(make_engine: Build) -> None:
    engine = make_engine(worker_extensions=(Probe,))
    assert engine.collective_rpc("device_name") == ["cpu"]
    assert engine.collective_rpc("pipeline_class", unique_reply_rank=0) == "SeededNoisePipeline"
    for refused in ("shutdown", "__init__", "call", "nonexistent"):
        with pytest.raises(RPCError, match="not callable"):
            engine.collective_rpc(refused)
    with pytest.raises(RPCError, match="unique_reply_rank"):
        engine.collective_rpc("device_name", unique_reply_rank=3)
    assert engine.generate(["still serving"], FAST)[0].ok


class CountingExecutor(UniProcExecutor):
    waves = 0

    def execute(self, scheduler_output: Any) -> Any:
        type(self).waves += 1
        return super().execute(scheduler_output)


def test_executor_backend_selection(make_engine: Build) -> None:
    engine = make_engine(executor_backend=CountingExecutor)
    engine.generate(["a"], FAST)
    assert CountingExecutor.waves >= 2  # warm-up and the request
    path = f"{__name__}:CountingExecutor"
    assert make_engine(executor_backend=path).generate(["b"], FAST)[0].ok
    assert make_engine(executor_backend="mp").generate(["c"], FAST)[0].ok
    with pytest.raises(TypeError, match="not a DiffusionExecutor"):
        make_engine(executor_backend="builtins:dict")
    assert issubclass(CountingExecutor, DiffusionExecutor)


def failing_factory(device: object) -> Any:
    raise OSError("weights not found")


class BadWarmup(SeededNoisePipeline):
    def warmup_request(self) -> tuple[Any, SamplingParams]:
        return "fail", SamplingParams(num_inference_steps=1)

    def forward(self, batch: Any) -> Any:
        raise RuntimeError("model is broken")


def test_failed_construction_or_warm_up_leaves_nothing_running() -> None:
    with pytest.raises(OSError, match="weights not found"):
        DiffusionEngine.make_engine(EngineConfig(pipeline=failing_factory, device="cpu"))
    with pytest.raises(RuntimeError, match="warm-up request failed: RuntimeError: model is broken"):
        DiffusionEngine.make_engine(EngineConfig(pipeline=BadWarmup, device="cpu"))
    with pytest.raises(ModuleNotFoundError, match="No module named 'nope'"):
        DiffusionEngine.make_engine(EngineConfig(pipeline="nope.missing:Pipeline", device="cpu"))
    assert engine_threads() == []


def test_engine_works_as_a_context_manager() -> None:
    with DiffusionEngine.make_engine(
        EngineConfig(pipeline="testing-noise", device="cpu")
    ) as engine:
        assert engine.generate("one", FAST)[0].ok
    assert engine.is_closed and engine_threads() == []


def test_check_health_after_close_and_reserved_rpc_methods(make_engine: Build) -> None:
    engine = make_engine()
    for reserved in ("execute_model", "release_requests"):
        with pytest.raises(RPCError, match="reserved for the executor"):
            engine.collective_rpc(reserved)
    engine.check_health()
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.check_health()


class LeakyExtension:
    """A worker extension holding a callable attribute: only its methods are RPCs."""

    def __init__(self, worker: Any) -> None:
        self.helper = print

    def ping(self) -> str:
        return "pong"


def test_only_extension_methods_become_rpc_methods(make_engine: Build) -> None:
    engine = make_engine(worker_extensions=(LeakyExtension,))
    assert engine.collective_rpc("ping", unique_reply_rank=0) == "pong"
    with pytest.raises(RPCError, match="not callable"):
        engine.collective_rpc("helper")


def test_a_scheduler_for_the_other_mode_is_refused() -> None:
    from diffusion_runtime.scheduler.step_scheduler import StepScheduler

    config = EngineConfig(pipeline="testing-noise", device="cpu")
    with pytest.raises(ValueError, match="StepScheduler schedules step mode"):
        DiffusionEngine(config, scheduler_cls=StepScheduler)
    assert engine_threads() == []


def test_a_single_non_list_prompt_is_one_request(make_engine: Build) -> None:
    engine = make_engine()
    [out] = engine.generate("abc", FAST)
    assert out.ok
    with pytest.raises(InvalidFieldError, match="prompt"):
        engine.generate(b"ab", FAST)


class HalfPipeline:
    def __init__(self, device: Any) -> None:
        self.device = device

    def forward(self, batch: Any) -> Any:
        return {}


def test_a_pipeline_without_the_contract_is_refused_at_start() -> None:
    from diffusion_runtime import PipelineContractError

    with pytest.raises(PipelineContractError, match="HalfPipeline lacks supports_request_batch"):
        DiffusionEngine.make_engine(EngineConfig(pipeline=HalfPipeline, device="cpu"))
    assert engine_threads() == []


def test_pil_images_by_channel_count() -> None:
    from diffusion_runtime.outputs import RequestOutput

    for channels, mode in [(1, "L"), (3, "RGB"), (4, "RGBA")]:
        out = RequestOutput(
            "r", RequestStatus.FINISHED_COMPLETED, True, torch.rand(2, channels, 4, 4), 0
        )
        assert [im.mode for im in out.pil_images()] == [mode, mode]


def test_a_subscriber_joining_mid_wave_sees_no_result_without_its_wave(
    make_engine: Build, faults: FaultInjectingPipeline
) -> None:
    from diffusion_runtime.fsm.audit import Auditor

    engine = make_engine(factory_of(faults), max_num_seqs=2)

    async def scenario() -> list[RequestOutput]:
        rid = await engine.add_request("gate", FAST)
        assert await asyncio.to_thread(faults.gate_entered.wait, 10)
        engine.machine.subscribe(auditor.feed)  # the wave is already running
        faults.gate_release.set()
        return await collect(engine, rid)

    auditor = Auditor()
    assert asyncio.run(scenario())[0].ok
    engine.generate(["after"], FAST)
    engine.close()
    assert auditor.finish() == []


def test_a_hook_calling_back_into_the_engine_fails_it_instead_of_deadlocking(
    make_engine: Build,
) -> None:
    from diffusion_runtime.fsm import Hook

    engine = make_engine()
    engine.machine.add_hook(Hook.TERMINAL, lambda request, event: engine.snapshot())
    # The hook raises inside the step that completes the request: the core dies
    # and every caller, this one first, gets the reason.
    with pytest.raises(EngineDeadError, match="cannot be made from a lifecycle hook"):
        engine.generate(["x"], FAST, timeout=30)
    with pytest.raises(EngineDeadError, match="cannot be made from a lifecycle hook"):
        engine.generate(["y"], FAST, timeout=30)


def test_an_abort_never_reaches_a_later_request_reusing_the_id(make_engine: Build) -> None:
    engine = make_engine()

    async def scenario() -> RequestOutput:
        first = await engine.add_request("a", FAST, request_id="same")
        assert (await collect(engine, first))[-1].ok
        engine.pause()
        engine.abort("same")  # finished: nothing to abort
        await engine.add_request("b", FAST, request_id="same")
        engine.resume()
        return (await collect(engine, "same"))[-1]

    assert asyncio.run(scenario()).ok


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_auditor_stays_quiet_when_a_dead_engine_is_closed(
    make_engine: Build, faults: FaultInjectingPipeline, mode: str
) -> None:
    from diffusion_runtime.fsm.audit import Auditor

    engine = make_engine(factory_of(faults), max_num_seqs=2, execution_mode=mode)
    auditor = Auditor()
    engine.machine.subscribe(auditor.feed)
    with pytest.raises(EngineDeadError):
        engine.generate(["a", "b", "device-fault"], SamplingParams(num_inference_steps=3))
    engine.close()
    assert auditor.dead and not auditor.complete
    assert [v.describe() for v in auditor.finish()] == []


class ThreadRecordingPipeline(SeededNoisePipeline):
    """Records the threads that built it and ran its forwards."""

    def __init__(self, device: Any) -> None:
        super().__init__(device)
        self.threads = [threading.current_thread()]

    def forward(self, batch: Any) -> Any:
        self.threads.append(threading.current_thread())
        return super().forward(batch)


def test_make_engine_builds_and_warms_up_off_the_callers_thread() -> None:
    """The in-process executor's torch work of building runs on a short-lived thread,
    so the caller's thread keeps no torch thread team; generate() then runs on the caller."""
    built: list[ThreadRecordingPipeline] = []

    def factory(device: Any) -> ThreadRecordingPipeline:
        built.append(ThreadRecordingPipeline(device))
        return built[0]

    config = EngineConfig(pipeline=factory, device="cpu", executor_backend="uni")
    with DiffusionEngine.make_engine(config) as engine:
        [pipeline] = built
        builder, warm_up = pipeline.threads
        assert builder is warm_up and builder is not threading.current_thread()
        assert not builder.is_alive()
        engine.generate(["a"], SamplingParams(num_inference_steps=2))
        assert pipeline.threads[-1] is threading.current_thread()
