"""The engine in a child process behind ZMQ: real stage processes, real torch pipelines.

What the stage process builds (pipelines, extensions) lives at module level so
that the spawned process can import it from this file. Most serving checks
share one stage (module scope); each failure check gets a stage of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import signal
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, TypeVar

import attrs
import msgspec
import pytest
import torch
import zmq
from conftest import wait_for
from pause_rounds import ROUNDS, check_round

from diffusion_runtime import (
    DiffusionEngine,
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
from diffusion_runtime.fsm.events import ADMIT, LifecycleEvent, TraceEvent, WaveEvent
from diffusion_runtime.fsm.trace import read_trace
from diffusion_runtime.outputs import STAGES
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepRequestState
from diffusion_runtime.stage import StageClient, StageStartError
from diffusion_runtime.stage.endpoints import bind
from diffusion_runtime.stage.messages import (
    Admitted,
    CollectiveRPC,
    Error,
    FromStage,
    Ready,
    Result,
    StageDead,
    Status,
    StatusQuery,
    decode_from_stage,
    encode,
)
from diffusion_runtime.stage.proc import EXIT_DEAD, EXIT_START_FAILED, StageSpec, run_stage
from diffusion_runtime.testing.leaks import Leftovers
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline

S = RequestStatus
T = TypeVar("T")
FAST = SamplingParams(num_inference_steps=3, seed=11)
#: Steps enough that a "tick" request outlasts whatever a test waits for.
LONG = SamplingParams(num_inference_steps=50, seed=11)


# -- what the stage process builds -------------------------------------------------------


class StagePipeline(FaultInjectingPipeline):
    """The fault-injecting pipeline with streaming previews and a gate across processes:
    a forward or step with a "hold" prompt leaves ``entered`` in ``gate_dir`` and
    waits there for ``release``; one with a "tick" prompt waits for ``release`` or
    for a ``tick``, which it consumes (so a test lets it run one step at a time)."""

    def __init__(self, device: Any = "cpu", gate_dir: str = "") -> None:
        super().__init__(device)
        self.gate_dir = Path(gate_dir)

    def forward(self, batch: Sequence[PipelineRequest]) -> Any:
        self._hold([request.prompt for request in batch])
        return super().forward(batch)

    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        self._hold([state.request.prompt for state in states])
        return super().denoise_step(states)

    def preview(self, state: StepRequestState) -> torch.Tensor:
        return torch.sigmoid(state.latents)

    def _hold(self, prompts: list[Any]) -> None:
        ticking = any("tick" in str(prompt) for prompt in prompts)
        if not ticking and not any("hold" in str(prompt) for prompt in prompts):
            return
        (self.gate_dir / "entered").touch()
        release, tick = self.gate_dir / "release", self.gate_dir / "tick"
        deadline = time.monotonic() + 30
        while not release.exists() and time.monotonic() < deadline:
            if ticking and tick.exists():
                tick.unlink()
                return
            time.sleep(0.005)


class Probe:
    """A worker extension: its public methods join the stage's RPC allow-list."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def pid(self) -> int:
        return os.getpid()

    def thread_names(self) -> list[str]:
        return sorted(thread.name for thread in threading.enumerate())

    def echo(self, value: Any) -> Any:
        return value

    def zeros(self) -> torch.Tensor:
        return torch.zeros(2)

    def _hidden(self) -> None:
        raise AssertionError("private extension methods are never callable")


class BlocksForever:
    """A pipeline whose constructor never returns."""

    def __init__(self, device: Any = "cpu") -> None:
        time.sleep(3600)


def fails_to_build(device: Any) -> Any:
    raise OSError("weights not found")


def exits_while_building(device: Any) -> Any:
    os._exit(3)


# -- helpers ---------------------------------------------------------------------------


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        await asyncio.sleep(0.005)


def open_descriptors() -> set[str]:
    """What this process's open file descriptors point at."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


class Gate:
    """The host side of :class:`StagePipeline`'s gate."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Gate:
        for name in ("entered", "release", "tick"):
            (self.path / name).unlink(missing_ok=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    async def entered(self) -> None:
        await until((self.path / "entered").exists)

    def release(self) -> None:
        (self.path / "release").touch()

    async def tick_until(self, waiting: Awaitable[T]) -> T:
        """Let a "tick" request run one step at a time until ``waiting`` is done (the
        stage reads messages and answers between two steps)."""
        future = asyncio.ensure_future(waiting)
        tick = self.path / "tick"
        while not future.done():
            tick.touch()
            await until(lambda: future.done() or not tick.exists())
        tick.unlink(missing_ok=True)
        return future.result()


def stage_config(gate_dir: Path, **overrides: Any) -> EngineConfig:
    overrides.setdefault("device", "cpu")
    return EngineConfig(
        pipeline=StagePipeline, pipeline_kwargs={"gate_dir": str(gate_dir)}, **overrides
    )


async def last_output(client: StageClient, request_id: str) -> RequestOutput:
    return [o async for o in client.stream(request_id)][-1]


def same_outputs(a: Sequence[RequestOutput], b: Sequence[RequestOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.status, x.finished, x.error, x.seed, x.step, x.num_steps) == (
            y.status,
            y.finished,
            y.error,
            y.seed,
            y.step,
            y.num_steps,
        )
        if x.image_batch is None:
            assert y.image_batch is None
        else:
            assert y.image_batch is not None and torch.equal(x.image_batch, y.image_batch)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no process, thread or socket directory it started."""
    baseline = Leftovers.baseline()
    yield
    left = baseline.since()
    assert not left, left


# -- serving: one shared stage ---------------------------------------------------------


@attrs.define
class Shared:
    """A stage over TCP and an in-process engine with the same config, on one event loop."""

    loop: asyncio.AbstractEventLoop
    client: StageClient
    engine: DiffusionEngine
    gate: Gate

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    gate_dir = tmp_path_factory.mktemp("gate")
    config = stage_config(
        gate_dir,
        streaming_output=True,
        preview_interval=2,
        max_num_seqs=4,
        worker_extensions=(Probe,),
    )
    loop = asyncio.new_event_loop()
    # A clean exit is asserted below: give it time to make it on a loaded machine.
    client = StageClient(config, transport="tcp", shutdown_grace_s=30.0)
    loop.run_until_complete(client.start())
    engine = DiffusionEngine.make_engine(config)

    # The async API's loop thread lives as long as the engine: start it before the tests.
    async def start_engine_loop() -> None:
        rid = await engine.add_request("cat", SamplingParams(num_inference_steps=1))
        assert [o.ok async for o in engine.stream(rid)] == [True]

    loop.run_until_complete(start_engine_loop())
    try:
        yield Shared(loop, client, engine, Gate(gate_dir))
    finally:
        engine.close()
        loop.run_until_complete(client.shutdown())
        loop.close()
    assert client.exitcode == 0
    assert wait_for(lambda: not multiprocessing.active_children())


def test_requests_and_batches_match_the_in_process_engine(shared: Shared) -> None:
    client, engine = shared.client, shared.engine
    prompts = ["cat", "dog", 7, "bad-step here", "owl"]
    params = [
        SamplingParams(num_inference_steps=2 + s, seed=s, num_outputs_per_prompt=1 + s % 2)
        for s in range(5)
    ]
    outputs = shared.run(client.generate(prompts, params))
    same_outputs(outputs, engine.generate(prompts, params))
    assert [o.ok for o in outputs] == [True, True, True, False, True]
    assert outputs[3].error == "ValueError: injected step failure"
    assert outputs[1].image_batch is not None and outputs[1].image_batch.shape == (2, 3, 16, 16)
    # Metrics cross whole: every stage's seconds, and the worker's memory peak.
    metrics = outputs[1].metrics
    assert metrics is not None and tuple(metrics.stage_durations) == STAGES
    assert metrics.stage_durations["denoise"] > 0.0
    assert metrics.peak_memory_mb is None or metrics.peak_memory_mb > 0.0
    # One params for all: the prompts cross in one message, admitted all or none.
    together = shared.run(client.generate(["cat", "dog", 7], FAST))
    same_outputs(together, engine.generate(["cat", "dog", 7], FAST))
    with pytest.raises(InvalidFieldError) as refused:
        shared.run(client.generate(["cat", 3.5], FAST))
    assert refused.value.field == "prompt" and shared.run(client.queue_length()) == 0

    batch_params = SamplingParams(num_inference_steps=3, seed=5, height=24, width=20)
    batch = shared.run(client.add_batch_request(["cat", 7, "owl"], batch_params))
    expected = engine.generate(["cat", 7, "owl"], batch_params)
    assert batch.ok and batch.finished and batch.seed == 5 and batch.error is None
    assert batch.image_batch is not None
    assert torch.equal(batch.image_batch, torch.cat([o.image_batch for o in expected]))

    unseeded = shared.run(client.add_batch_request(["cat", "cat"], SamplingParams(3)))
    assert unseeded.image_batch is not None and unseeded.ok
    assert torch.equal(unseeded.image_batch[0], unseeded.image_batch[1])  # one seed for all
    again = engine.generate(["cat"], SamplingParams(3, seed=unseeded.seed))[0]
    assert again.image_batch is not None and torch.equal(again.image_batch[0], unseeded.images[0])

    partial = shared.run(client.add_batch_request(["cat", "bad-step", "owl"], batch_params))
    assert partial.status is S.FINISHED_ERROR and partial.image_batch is None
    assert partial.error == "prompt 1: ValueError: injected step failure"


def test_streamed_outputs_and_previews_cross_as_in_process(shared: Shared) -> None:
    params = SamplingParams(num_inference_steps=5, seed=3, height=8, width=8)

    async def both() -> tuple[list[RequestOutput], list[RequestOutput]]:
        rid = await shared.client.add_request("cat", params)
        local = await shared.engine.add_request("cat", params)
        return (
            [o async for o in shared.client.stream(rid)],
            [o async for o in shared.engine.stream(local)],
        )

    remote, local = shared.run(both())
    same_outputs(remote, local)
    assert [(o.step, o.finished) for o in remote] == [
        (1, False),
        (2, False),
        (3, False),
        (4, False),
        (5, True),
    ]
    assert [o.image_batch is not None for o in remote] == [False, True, False, True, True]
    assert all(o.status is S.RUNNING for o in remote[:-1]) and remote[-1].ok


def test_a_prompt_nested_too_deep_is_refused_by_field_before_it_is_sent(shared: Shared) -> None:
    deep: Any = "x"
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(InvalidFieldError, match=r"request\.prompt "):
        shared.run(shared.client.add_request(deep, SamplingParams(num_inference_steps=1)))
    with pytest.raises(InvalidFieldError, match=r"request\.prompts "):
        shared.run(
            shared.client.add_batch_request(["a", deep], SamplingParams(num_inference_steps=1))
        )


def test_abort_ends_requests_and_batches_with_an_aborted_output(shared: Shared) -> None:
    client = shared.client

    async def scenario() -> tuple[list[RequestOutput], RequestOutput]:
        with shared.gate as gate:
            rid = await client.add_request("tick me", LONG)
            await gate.entered()
            client.abort(rid)
            # Answered after the stage applied the abort, between two steps.
            await gate.tick_until(client.queue_length())
            single = [o async for o in client.stream(rid)]
        with shared.gate as gate:
            batch = asyncio.ensure_future(
                client.add_batch_request(["tick", "b"], LONG, request_id="batch-1")
            )
            await gate.entered()
            client.abort("batch-1", "enough")
            await gate.tick_until(client.queue_length())
            return single, await batch

    events: list[TraceEvent] = []
    client.batch_machine.subscribe(events.append)
    try:
        single, batch = shared.run(scenario())
    finally:
        client.batch_machine.unsubscribe(events.append)
    assert [(e.trigger, e.reason) for e in events if isinstance(e, LifecycleEvent)] == [
        (ADMIT, None),
        ("schedule", None),
        ("abort", "enough"),
    ]
    assert single[-1].status is S.FINISHED_ABORTED and single[-1].image_batch is None
    assert single[-1].error == "aborted by the caller"
    assert batch.status is S.FINISHED_ABORTED and batch.image_batch is None
    assert batch.error == "enough"
    assert shared.run(client.generate(["after"], FAST))[0].ok


def test_collective_rpc_calls_only_allow_listed_methods(shared: Shared) -> None:
    client = shared.client
    assert {"pid", "echo", "check_health", "device_name"} <= client.rpc_methods
    assert not {"execute_model", "release_requests", "_hidden"} & client.rpc_methods
    value = {"a": [1, 2.5, None], "b": "text"}
    assert shared.run(client.collective_rpc("echo", [value])) == [value]
    assert shared.run(client.collective_rpc("device_name", unique_reply_rank=0)) == "cpu"
    assert shared.run(client.collective_rpc("pid", unique_reply_rank=0)) == client.pid
    for method in ("execute_model", "release_requests", "shutdown", "_hidden", "__init__", "x"):
        with pytest.raises(RPCError, match="not on the stage's RPC allow-list"):
            shared.run(client.collective_rpc(method))
    with pytest.raises(RPCError, match="cannot cross as msgpack"):
        shared.run(client.collective_rpc("echo", [object()]))
    with pytest.raises(RPCError, match="reply of 'zeros' cannot cross"):
        shared.run(client.collective_rpc("zeros"))
    shared.run(client.check_health())


def test_health_queue_length_and_admission_errors(shared: Shared) -> None:
    client = shared.client

    async def queued_behind_a_running_request() -> tuple[int, list[RequestOutput]]:
        small = attrs.evolve(FAST, height=8, width=8)  # cannot join the running request
        with shared.gate as gate:
            running = await client.add_request("tick", LONG)
            await gate.entered()
            waiting = await gate.tick_until(
                asyncio.gather(*(client.add_request(p, small) for p in ("x", "y")))
            )
            length = await gate.tick_until(client.queue_length())
        finals = [await last_output(client, rid) for rid in [running, *waiting]]
        return length, finals

    shared.run(client.check_health())
    assert shared.run(client.queue_length()) == 0
    length, finals = shared.run(queued_behind_a_running_request())
    assert length == 2 and all(o.ok for o in finals)

    with pytest.raises(InvalidFieldError) as bad_prompt:
        shared.run(client.add_request(3.5, FAST))
    assert bad_prompt.value.field == "prompt" and bad_prompt.value.value == 3.5
    with pytest.raises(InvalidFieldError, match="height must be at most 256") as too_tall:
        shared.run(client.add_request("x", SamplingParams(height=1000)))
    assert too_tall.value.field == "height"
    with pytest.raises(InvalidFieldError, match="msgpack") as unencodable:
        shared.run(client.add_request(object(), FAST))
    assert unencodable.value.field == "prompt"
    with pytest.raises(InvalidFieldError, match="must not be empty"):
        shared.run(client.add_batch_request([], FAST))
    shared.run(client.add_request("x", FAST, request_id="dup"))
    with pytest.raises(DuplicateRequestError):
        shared.run(client.add_request("x", FAST, request_id="dup"))

    async def read(rid: str) -> list[RequestOutput]:
        return [o async for o in client.stream(rid)]

    assert shared.run(read("dup"))[-1].ok
    with pytest.raises(KeyError):
        shared.run(read("dup"))


def test_the_client_decides_ids_and_params_without_asking_the_stage(shared: Shared) -> None:
    """While the stage is inside a step that waits for the gate, it answers nothing:
    every refusal here comes from the client, the front."""
    client = shared.client

    async def scenario() -> list[RequestOutput]:
        with shared.gate as gate:
            rid = await client.add_request("hold", FAST, request_id="taken/0")
            await gate.entered()
            with pytest.raises(DuplicateRequestError, match="'taken/0' is taken"):
                await client.add_request("x", FAST, request_id="taken/0")
            with pytest.raises(DuplicateRequestError, match="'taken/0' is taken"):
                await client.add_batch_request(["x"], FAST, request_id="taken")  # its prompt 0
            with pytest.raises(InvalidFieldError, match="request_id"):
                await client.add_request("x", FAST, request_id="")
            with pytest.raises(InvalidFieldError, match="params"):
                await client.add_request("x", {"seed": 1})  # type: ignore[arg-type]
            with pytest.raises(InvalidFieldError, match="timeout"):
                await client.collective_rpc("echo", [1], timeout=-1.0)
            for front in (client, shared.engine):  # the same errors at call as in process
                with pytest.raises(KeyError, match="no unclaimed output stream"):
                    front.stream("unknown")
            gate.release()
        return [o async for o in client.stream(rid)]

    assert shared.run(scenario())[-1].ok


def test_a_batch_parent_lives_its_own_lifecycle(shared: Shared) -> None:
    client = shared.client
    events: list[TraceEvent] = []
    client.batch_machine.subscribe(events.append)
    try:
        done = shared.run(client.add_batch_request(["cat", "owl"], FAST, request_id="p-ok"))
        failed = shared.run(
            client.add_batch_request(["cat", "bad-step", "owl"], FAST, request_id="p-bad")
        )
    finally:
        client.batch_machine.unsubscribe(events.append)
    assert done.ok and failed.status is S.FINISHED_ERROR and failed.image_batch is None
    assert failed.error == "prompt 1: ValueError: injected step failure"
    assert [
        (e.request_id, e.trigger, e.dest, e.reason) for e in events if isinstance(e, LifecycleEvent)
    ] == [
        ("p-ok", ADMIT, S.WAITING, None),
        ("p-ok", "schedule", S.RUNNING, None),
        ("p-ok", "complete", S.FINISHED_COMPLETED, None),
        ("p-bad", ADMIT, S.WAITING, None),
        ("p-bad", "schedule", S.RUNNING, None),
        ("p-bad", "fail", S.FINISHED_ERROR, failed.error),
    ]
    # Every prompt of the failed batch ended (the others were aborted) before its output came.
    assert shared.run(client.queue_length()) == 0
    shared.run(client.add_request("cat", FAST, request_id="p-bad/1"))  # its ids are free again
    assert shared.run(last_output(client, "p-bad/1")).ok


# -- the protocol on a raw socket --------------------------------------------------------


def test_bad_frames_never_kill_the_stage_and_sigterm_exits_143(tmp_path: Path) -> None:
    """Drives the stage process with hand-made frames; replies are read in order."""
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    requests = ctx.socket(zmq.PUSH)
    spec = StageSpec(
        stage_config(tmp_path, worker_extensions=(Probe,)),
        reply_endpoint=bind(replies, f"ipc://{tmp_path}/replies"),
        request_address=f"ipc://{tmp_path}/requests",
        max_frame_bytes=64 * 1024,
    )
    process = multiprocessing.get_context("spawn").Process(target=run_stage, args=(spec,))
    process.start()

    def reply() -> FromStage:
        assert replies.poll(60_000), "no reply from the stage"
        return decode_from_stage(replies.recv())

    def status_is_next(call_id: int) -> None:
        requests.send(encode(StatusQuery(call_id)))
        assert reply() == Status(call_id, True, None, 0)

    params = {
        "num_inference_steps": 2,
        "guidance_scale": 1,
        "seed": 1,
        "num_outputs_per_prompt": 1,
        "height": None,
        "width": None,
        "extra_args": {},
    }

    def add(request_id: str, **fields: Any) -> bytes:
        body = {
            "type": "AddRequest",
            "request_id": request_id,
            "prompt": "p",
            "params": params,
            "seed": 1,
        }
        return msgspec.msgpack.encode({**body, **fields})

    try:
        ready = reply()
        assert isinstance(ready, Ready) and ready.pid == process.pid
        requests.connect(ready.request_endpoint)

        # Unreadable, or readable but untied to any request: logged and dropped.
        for junk in (b"\xc1", b"", msgspec.msgpack.encode([1, 2]), encode(StatusQuery(0))[:-1]):
            requests.send(junk)
        # Nested deeper than any decoder goes (a one-element array, 3,000 times over).
        too_deep = b"\x86" + add("too-deep")[1:] + msgspec.msgpack.encode("x") + b"\x91" * 3000
        requests.send(too_deep + msgspec.msgpack.encode("p"))
        status_is_next(1)

        # Readable enough to name a request or a call: an Error reply says why.
        requests.send(msgspec.msgpack.encode({"type": "Launch", "call_id": 2}))
        unknown = reply()
        assert isinstance(unknown, Error) and unknown.call_id == 2
        assert unknown.kind == "ProtocolError" and "Invalid value 'Launch'" in unknown.message
        requests.send(add("r1", params={**params, "seed": "seven"}))
        wrong_type = reply()
        assert isinstance(wrong_type, Error) and wrong_type.request_id == "r1"
        assert "Expected `int | null`, got `str` - at `$.params.seed`" in wrong_type.message
        requests.send(add("r2", params={**params, "num_inference_steps": 0}))
        out_of_range = reply()
        assert isinstance(out_of_range, Error) and out_of_range.request_id == "r2"
        assert out_of_range.kind == "InvalidFieldError" and out_of_range.field_error is not None
        assert out_of_range.field_error.field == "num_inference_steps"
        requests.send(add("r3", priority=1))
        extra_field = reply()
        assert isinstance(extra_field, Error) and "unknown field" in extra_field.message
        requests.send_multipart([add("r4"), b"tail"])
        two_frames = reply()
        assert isinstance(two_frames, Error) and two_frames.request_id == "r4"
        requests.send(encode(CollectiveRPC(3, "execute_model", [], {}, None, None)))
        refused = reply()
        assert isinstance(refused, Error) and refused.kind == "RPCError" and refused.call_id == 3

        # The stage still serves: a request's images follow its Result as raw bytes.
        requests.send(add("ok"))
        assert reply() == Admitted("ok")
        header, image = replies.recv_multipart()
        result = decode_from_stage(header)
        assert isinstance(result, Result) and result.request_id == "ok"
        assert result.status is S.FINISHED_COMPLETED and result.image is not None
        assert result.image.dtype == "float32" and result.image.shape == [1, 3, 16, 16]
        assert len(image) == 3 * 16 * 16 * 4

        # The seed is the client's: the stage draws none of its own, and checks its range.
        requests.send(add("seeded", params={**params, "seed": None}, seed=1234))
        assert reply() == Admitted("seeded")
        seeded = decode_from_stage(replies.recv_multipart()[0])
        assert isinstance(seeded, Result) and seeded.seed == 1234
        assert seeded.status is S.FINISHED_COMPLETED
        requests.send(add("bad-seed", seed=-1))
        bad_seed = reply()
        assert isinstance(bad_seed, Error) and bad_seed.kind == "ProtocolError"
        assert "$.seed" in bad_seed.message
        # The core's duplicate check is the stage's only one: a batch is admitted whole or
        # not at all (the child admitted before the refusal is aborted at once).
        batch = {**msgspec.msgpack.decode(add("b")), "type": "AddRequests", "seeds": [1, 2]}
        del batch["prompt"], batch["seed"]
        requests.send(
            msgspec.msgpack.encode({**batch, "child_ids": ["d", "d"], "prompts": ["p", "q"]})
        )
        duplicate = reply()
        assert isinstance(duplicate, Error) and duplicate.request_id == "b"
        assert duplicate.kind == "DuplicateRequestError"
        aborted = reply()
        assert isinstance(aborted, Result) and aborted.request_id == "d"
        assert aborted.status is S.FINISHED_ABORTED
        status_is_next(4)

        os.kill(process.pid, signal.SIGTERM)
        assert reply() == StageDead("the stage was stopped by SIGTERM")
        process.join(30)
        assert process.exitcode == 128 + signal.SIGTERM == 143
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_what_was_sent_while_paused_is_scheduled_together_and_aborts_apply_first(
    tmp_path: Path, mode: str
) -> None:
    """300 rounds of pause, admit three, admit and abort a fourth, resume; the
    waves are read from the stage's trace once it has stopped."""
    trace = tmp_path / "trace.jsonl"
    config = EngineConfig(
        pipeline="testing-noise",
        device="cpu",
        execution_mode=mode,
        max_num_seqs=4,
        warmup=False,
        trace_path=str(trace),
    )
    params = SamplingParams(num_inference_steps=2, seed=3)
    rounds: list[tuple[list[str], str, dict[str, RequestOutput]]] = []

    async def scenario() -> None:
        async with StageClient(config) as client:
            for _ in range(ROUNDS):
                await client.pause()
                together = [await client.add_request(str(i), params) for i in range(3)]
                victim = await client.add_request("9", params)
                client.abort(victim)
                await client.resume()
                finals = {rid: await last_output(client, rid) for rid in [*together, victim]}
                rounds.append((together, victim, finals))

    asyncio.run(scenario())
    waves = [event for event in read_trace(trace) if isinstance(event, WaveEvent)]
    for number, (together, victim, finals) in enumerate(rounds):
        try:
            check_round(together, victim, finals, waves)
        except AssertionError as exc:
            raise AssertionError(f"round {number} of {ROUNDS}: {exc}") from None


# -- failures --------------------------------------------------------------------------


def test_a_device_fault_kills_the_stage_and_fails_every_pending_call(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with StageClient(stage_config(tmp_path, max_num_seqs=1)) as client:
            with Gate(tmp_path) as gate:
                first = await client.add_request("hold, then device-fault", FAST)
                await gate.entered()
                # Answered between steps: after the held step, which kills the core.
                queued = asyncio.ensure_future(client.add_request("waits", FAST))
            with pytest.raises(EngineDeadError, match="injected device fault"):
                [o async for o in client.stream(first)]
            with pytest.raises(EngineDeadError, match="injected device fault"):
                await queued
            with pytest.raises(EngineDeadError, match="injected device fault"):
                await client.check_health()
            with pytest.raises(EngineDeadError):
                await client.generate(["after"], FAST)
            await until(lambda: client.exitcode is not None)
            assert client.exitcode == EXIT_DEAD

    asyncio.run(scenario())


def test_a_worker_killed_inside_the_stage_fails_pending_calls_within_a_second(
    tmp_path: Path,
) -> None:
    config = stage_config(
        tmp_path,
        executor_backend="mp",
        worker_extensions=(Probe,),
        worker_start_timeout_s=60.0,
        shutdown_grace_s=0.5,
    )

    async def scenario() -> None:
        async with StageClient(config) as client:
            [worker] = await client.collective_rpc("pid")
            assert worker != client.pid
            with Gate(tmp_path) as gate:
                rid = await client.add_request("hold", FAST)
                await gate.entered()
                os.kill(worker, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(EngineDeadError, match=r"worker 0 .* killed by SIGKILL"):
                    [o async for o in client.stream(rid)]
                assert time.monotonic() - killed < 1.0
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await client.queue_length()
            await until(lambda: client.exitcode is not None)
            assert client.exitcode == EXIT_DEAD

    asyncio.run(scenario())


def test_a_stage_that_vanishes_fails_pending_calls_at_once(tmp_path: Path) -> None:
    async def scenario() -> str:
        async with StageClient(stage_config(tmp_path)) as client:
            assert client.socket_dir is not None
            socket_dir = client.socket_dir
            assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
            assert sorted(os.listdir(socket_dir)) == ["replies", "requests"]
            with Gate(tmp_path) as gate:
                rid = await client.add_request("hold", FAST)
                await gate.entered()
                rpc = asyncio.ensure_future(client.collective_rpc("device_name"))
                assert client.pid is not None
                os.kill(client.pid, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(EngineDeadError, match=r"killed by SIGKILL \(exit code -9\)"):
                    [o async for o in client.stream(rid)]
                with pytest.raises(EngineDeadError, match="SIGKILL"):
                    await rpc
                assert time.monotonic() - killed < 1.0
            with pytest.raises(EngineDeadError):
                await client.add_request("after", FAST)
        await client.shutdown()
        with pytest.raises(EngineDeadError):  # dead wins over closed, as in the engine
            await client.check_health()
        return socket_dir

    assert not os.path.exists(asyncio.run(scenario()))


def test_shutdown_is_idempotent_and_fails_what_is_pending(tmp_path: Path) -> None:
    async def scenario() -> None:
        config = stage_config(tmp_path, worker_extensions=(Probe,))
        client = StageClient(config, shutdown_grace_s=30.0)
        await client.start()
        # Over IPC the stage runs on its one thread (the uni worker too): a loop, not a
        # DiffusionEngine with its loop thread and an RPC pool.
        assert await client.collective_rpc("thread_names", unique_reply_rank=0) == ["MainThread"]
        done = await client.add_request("x", FAST)
        [finished] = await client.generate(["y"], FAST)  # "x" ran in the same or an earlier wave
        with Gate(tmp_path) as gate:
            held = await client.add_request("hold", FAST)
            await gate.entered()
            stopping = asyncio.ensure_future(client.shutdown())
            with pytest.raises(EngineClosedError, match="shut down"):
                [o async for o in client.stream(held)]
        await stopping
        await client.shutdown()
        assert client.exitcode == 0 and finished.ok
        # Outputs that arrived before the shutdown stay readable, as in the engine.
        assert [o.ok for o in [o async for o in client.stream(done)]] == [True]
        with pytest.raises(EngineClosedError):
            await client.add_request("after", FAST)
        client.abort(held)  # a no-op once shut down

    resource_tracker.ensure_running()  # multiprocessing's own, for the life of this process
    descriptors = open_descriptors()
    asyncio.run(scenario())
    gc.collect()
    assert open_descriptors() <= descriptors  # sockets, pipes, the ZMQ context's too


def test_a_client_dropped_without_shutdown_takes_its_stage_down(tmp_path: Path) -> None:
    async def forgotten() -> StageClient:
        client = StageClient(stage_config(tmp_path))
        return await client.start()

    client = asyncio.run(forgotten())
    pid, socket_dir = client.pid, client.socket_dir
    assert pid is not None and socket_dir is not None and os.path.exists(socket_dir)
    del client
    gc.collect()
    assert not Path("/proc", str(pid)).exists()
    assert not os.path.exists(socket_dir)


# -- start-up --------------------------------------------------------------------------


def test_a_stage_that_is_never_ready_is_stopped_after_the_timeout() -> None:
    config = EngineConfig(pipeline=BlocksForever, device="cpu")
    with pytest.raises(StageStartError, match=r"not ready after 2.0 s; stopped it") as error:
        asyncio.run(StageClient(config, start_timeout_s=2.0).start())
    assert error.value.exitcode in (143, -signal.SIGTERM)


def test_a_stage_that_fails_to_start_reports_its_error_and_exit_code() -> None:
    async def start(config: EngineConfig) -> None:
        async with StageClient(config):
            raise AssertionError("the stage should not start")

    with pytest.raises(StageStartError, match="OSError: weights not found") as built:
        asyncio.run(start(EngineConfig(pipeline=fails_to_build, device="cpu")))
    assert built.value.exitcode == EXIT_START_FAILED
    assert built.value.child_error == "OSError: weights not found"
    assert built.value.child_traceback is not None
    assert 'raise OSError("weights not found")' in built.value.child_traceback
    assert f"exited with code {EXIT_START_FAILED}" in str(built.value)

    with pytest.raises(StageStartError, match=r"exited with code 3 during start-up") as crashed:
        asyncio.run(start(EngineConfig(pipeline=exits_while_building, device="cpu")))
    assert crashed.value.exitcode == 3 and crashed.value.child_error is None

    with pytest.raises(InvalidFieldError, match="module-level factory"):
        StageClient(EngineConfig(pipeline=lambda device: None, device="cpu"))
    with pytest.raises(InvalidFieldError, match="transport"):
        StageClient(EngineConfig(device="cpu"), transport="udp")
