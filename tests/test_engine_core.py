"""EngineCore driven directly, and how the in-process front drives it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from conftest import factory_of

from diffusion_runtime import DiffusionEngine, EngineConfig, RequestStatus, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm.events import TraceEvent, WaveEvent
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.testing.pipelines import SeededNoisePipeline

FAST = SamplingParams(num_inference_steps=2, seed=5)


class ThreadRecordingPipeline(SeededNoisePipeline):
    """Records which thread ran each forward."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.threads: list[int] = []

    def forward(self, batch: Sequence[PipelineRequest]) -> dict[str, Any]:
        self.threads.append(threading.get_ident())
        return super().forward(batch)


def test_a_custom_loop_drives_the_core_and_gets_outputs_as_values() -> None:
    core = EngineCore(EngineConfig(pipeline="testing-noise", device="cpu", max_num_seqs=4))
    try:
        for i, prompt in enumerate(["a", "b", "c"]):
            core.add_request(f"r{i}", prompt, FAST, seed=i)
        core.abort(["r2"], "changed my mind")
        outputs = []
        while core.has_unfinished():
            outputs += core.step().outputs
        by_id = {o.request_id: o for o in outputs}
        assert sorted(by_id) == ["r0", "r1", "r2"] and all(o.finished for o in outputs)
        assert by_id["r2"].status is RequestStatus.FINISHED_ABORTED
        assert by_id["r2"].error == "changed my mind"
        for rid in ("r0", "r1"):
            images = by_id[rid].image_batch
            assert by_id[rid].ok and images is not None and images.shape[0] == 1
        assert not core.snapshot().scheduler_ids
    finally:
        core.shutdown()


def test_generate_runs_the_pipeline_on_the_calling_thread() -> None:
    pipeline = ThreadRecordingPipeline()
    config = EngineConfig(pipeline=factory_of(pipeline), device="cpu", warmup=False)
    with DiffusionEngine(config) as engine:
        outputs = engine.generate(["a", "b"], FAST)
        assert all(o.ok for o in outputs)
        assert set(pipeline.threads) == {threading.get_ident()}
        assert [t.name for t in threading.enumerate() if t.name == "diffusion-engine-loop"] == []


def test_the_async_api_runs_a_loop_thread_that_generate_then_waits_on() -> None:
    pipeline = ThreadRecordingPipeline()
    config = EngineConfig(pipeline=factory_of(pipeline), device="cpu", warmup=False)
    with DiffusionEngine(config) as engine:

        async def one() -> list[bool]:
            rid = await engine.add_request("a", FAST)
            return [o.ok async for o in engine.stream(rid)]

        assert asyncio.run(one()) == [True]
        assert engine.generate(["b"], FAST)[0].ok
        assert threading.get_ident() not in pipeline.threads  # the loop thread ran both


def test_request_mode_sends_no_release_only_waves() -> None:
    events: list[TraceEvent] = []
    config = EngineConfig(pipeline="testing-noise", device="cpu", max_num_seqs=2)
    with DiffusionEngine.make_engine(config) as engine:
        engine.machine.subscribe(events.append)
        engine.generate(["a", "b", "c", "d", "e"], FAST)

        async def aborted() -> RequestStatus:
            rid = await engine.add_request("f", FAST)
            engine.abort(rid)
            return [o async for o in engine.stream(rid)][-1].status

        asyncio.run(aborted())
        engine.generate(["g"], FAST)
    waves = [e for e in events if isinstance(e, WaveEvent)]
    assert len(waves) >= 4
    assert all(w.new_ids and not w.finished_ids for w in waves), waves


def test_step_mode_releases_a_running_request_aborted_between_steps() -> None:
    core = EngineCore(EngineConfig(pipeline="testing-noise", device="cpu", execution_mode="step"))
    try:
        core.add_request("long", "a", SamplingParams(num_inference_steps=50, seed=1), seed=1)
        core.step()
        assert core.snapshot().runner_cached_ids == {"long"}
        core.abort(["long"])  # queued: the next step applies it before it schedules
        result = core.step()
        [final] = result.outputs
        assert final.status is RequestStatus.FINISHED_ABORTED and final.image_batch is None
        # The release travelled in that step's output: nothing is held once it returns.
        assert result.executed and result.wake_at is None
        snapshot = core.snapshot()
        assert not snapshot.runner_cached_ids and not snapshot.scheduler_ids
    finally:
        core.shutdown()


def test_outputs_are_bit_identical_to_the_pipeline_called_directly() -> None:
    core = EngineCore(EngineConfig(pipeline="testing-noise", device="cpu"))
    try:
        core.add_request("x", "p", FAST, seed=9)
        outputs = []
        while core.has_unfinished():
            outputs += core.step().outputs
        request = PipelineRequest("x", "p", FAST, 9, torch.device("cpu"))
        direct = SeededNoisePipeline("cpu").forward([request])["x"]
        assert outputs[0].image_batch is not None and torch.equal(outputs[0].image_batch, direct)
    finally:
        core.shutdown()


def test_the_embedding_guide_custom_engine_runs(tmp_path: Path) -> None:
    from test_docs_examples import DOCS, run_block

    assert run_block(tmp_path, DOCS / "embedding.md", "EngineCore(") == "True\nTrue\n"


def test_stream_refuses_an_unknown_id_and_another_event_loop_at_the_call() -> None:
    config = EngineConfig(pipeline="testing-noise", device="cpu", warmup=False)
    with DiffusionEngine(config) as engine:
        try:
            engine.stream("nope")
        except KeyError as error:
            assert "no unclaimed output stream for request 'nope'" in str(error)
        else:
            raise AssertionError("stream('nope') returned")

        first = asyncio.new_event_loop()
        try:
            rid = first.run_until_complete(engine.add_request("a", FAST))

            async def read_elsewhere() -> None:
                engine.stream(rid)

            try:
                asyncio.run(read_elsewhere())
            except RuntimeError as error:
                assert "was added on another event loop" in str(error)
            else:
                raise AssertionError("a stream was read on another loop")

            async def read_here() -> list[bool]:
                return [o.ok async for o in engine.stream(rid)]

            assert first.run_until_complete(read_here()) == [True]  # still claimable
        finally:
            first.close()
