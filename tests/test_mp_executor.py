"""The mp executor: real worker processes, real torch pipelines, nothing left behind.

Classes that workers must build (pipelines, extensions) live at module level
so that spawned processes can import them from this file.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import unittest
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import hypothesis.strategies as st
import pytest
import torch
from conftest import (
    child_pids,
    engine_threads,
    factory_of,
    suite_device,
    suite_device_index,
    wait_for,
)
from executor_helpers import (
    DEEPER_THAN_PICKLE,
    GatedPipeline,
    PreviewingNoise,
    chain,
    run_in_thread,
)
from hypothesis import HealthCheck, settings

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    EngineDeadError,
    InvalidFieldError,
    RequestOutput,
    RequestStatus,
    RPCError,
    SamplingParams,
    register_pipeline,
)
from diffusion_runtime.contracts import NewRequestData, SchedulerOutput
from diffusion_runtime.executor.mp import MultiprocExecutor, WorkerStartError
from diffusion_runtime.executor.mp.messages import ComputeDone, FromWorker, OutputReady
from diffusion_runtime.executor.mp.segments import SEGMENT_PREFIX, segment_names
from diffusion_runtime.testing.harness import lifecycle_test_case
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline, SeededNoisePipeline

FAST = SamplingParams(num_inference_steps=3, seed=11, height=32, width=32)


# -- what the workers build ------------------------------------------------------------


class Probe:
    """A worker extension: each public method is an RPC method on every rank."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def rank(self) -> int:
        return int(self.worker.rank)

    def pid(self) -> int:
        return os.getpid()

    def forward_batches(self) -> list[list[str]]:
        return list(self.worker.pipeline.forward_batches)

    def all_reduce_rank(self) -> int:
        total = torch.tensor([self.worker.rank], device=self.worker.device)
        torch.distributed.all_reduce(total)
        return int(total.item())

    def wait_for_file(self, path: str) -> str:
        """Block this rank's command loop until ``path`` exists."""
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)
        return "late"

    def raise_value_error(self, message: str) -> None:
        raise ValueError(message)


class FailsOnRankOne:
    """A worker extension whose construction fails on rank 1 only."""

    def __init__(self, worker: Any) -> None:
        if worker.rank == 1:
            raise OSError("weights not found on rank 1")


def exits_during_start(device: Any) -> Any:
    os._exit(3)


class AlternatingOrder(MultiprocExecutor):
    """Delivers each wave's two messages in a forced order, alternating by wave:
    OutputReady first, then ComputeDone first, and so on."""

    orders: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, config: EngineConfig) -> None:
        self._pairs: dict[int, dict[type, FromWorker]] = {}
        super().__init__(config)

    def _on_worker_message(self, message: FromWorker) -> None:
        if not isinstance(message, (ComputeDone, OutputReady)):
            super()._on_worker_message(message)
            return
        pair = self._pairs.setdefault(message.call_id, {})
        pair[type(message)] = message
        if len(pair) < 2:
            return
        del self._pairs[message.call_id]
        kinds = [OutputReady, ComputeDone]
        if len(self.orders) % 2:
            kinds.reverse()
        for kind in kinds:
            super()._on_worker_message(pair[kind])
        self.orders.append((kinds[0].__name__, kinds[1].__name__))


class HeldOutput(MultiprocExecutor):
    """Holds each OutputReady in the result pump until the test lets it through."""

    def __init__(self, config: EngineConfig) -> None:
        self.output_arrived = threading.Event()
        self.let_through = threading.Event()
        super().__init__(config)

    def _on_worker_message(self, message: FromWorker) -> None:
        if isinstance(message, OutputReady) and message.slots:
            self.output_arrived.set()
            assert self.let_through.wait(30)
        super()._on_worker_message(message)


register_pipeline("mp-test-faults", FaultInjectingPipeline)
register_pipeline("mp-test-lambda", lambda device: SeededNoisePipeline(device))


# -- helpers ---------------------------------------------------------------------------


def our_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("diffusion-")]


def mp_config(pipeline: Any = "testing-faults", **overrides: Any) -> EngineConfig:
    overrides.setdefault("device", suite_device_index())  # several workers share one GPU
    overrides.setdefault("executor_backend", "mp")
    overrides.setdefault("worker_start_timeout_s", 60.0)
    return EngineConfig(pipeline=pipeline, **overrides)


def wave(wave_id: int, prompts: dict[str, str], params: SamplingParams = FAST) -> SchedulerOutput:
    new = tuple(NewRequestData(rid, prompt, params, 1) for rid, prompt in prompts.items())
    return SchedulerOutput(wave_id, new, (), (), len(new), 0)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no worker process, runtime thread or shared-memory segment."""
    yield
    assert wait_for(lambda: not multiprocessing.active_children() and not child_pids())
    assert wait_for(lambda: not our_threads()), our_threads()
    assert segment_names(f"{SEGMENT_PREFIX}{os.getpid()}-") == []


Build = Callable[[EngineConfig], DiffusionEngine]


@pytest.fixture
def engines() -> Iterator[Build]:
    built: list[DiffusionEngine] = []

    def build(config: EngineConfig) -> DiffusionEngine:
        engine = DiffusionEngine.make_engine(config)
        built.append(engine)
        return engine

    yield build
    for engine in built:
        engine.close()
    assert engine_threads() == []


def same_results(a: Sequence[RequestOutput], b: Sequence[RequestOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.status, x.error, x.seed) == (y.status, y.error, y.seed)
        if x.image_batch is None:
            assert y.image_batch is None
        else:
            assert y.image_batch is not None and torch.equal(x.image_batch, y.image_batch)


# -- serving ---------------------------------------------------------------------------

# Small waves travel inside their OutputReady message; "owl" (two 160x160
# images, its own wave) crosses through shared memory.
PROMPTS = ["cat", "dog", 7, "cat", "fail now", "owl"]
PARAMS = [
    SamplingParams(num_inference_steps=4, seed=s, height=64, width=64, num_outputs_per_prompt=n)
    for s, n in [(1, 1), (2, 2), (3, 1), (4, 1)]
] + [
    SamplingParams(num_inference_steps=2, seed=5, height=64, width=64),
    SamplingParams(num_inference_steps=4, seed=6, height=160, width=160, num_outputs_per_prompt=2),
]
LARGE = SamplingParams(num_inference_steps=2, seed=1, height=160, width=160)


def test_one_worker_serves_the_same_bits_as_uni_and_survives_request_failures(
    engines: Build,
) -> None:
    uni = engines(mp_config(executor_backend="uni", max_num_seqs=4))
    mp = engines(mp_config(max_num_seqs=4))
    expected = uni.generate(PROMPTS, PARAMS)
    outputs = mp.generate(PROMPTS, PARAMS)
    same_results(expected, outputs)
    assert [o.ok for o in outputs] == [True, True, True, True, False, True]
    assert outputs[4].error == "RuntimeError: injected failure"
    assert outputs[1].image_batch is not None and outputs[1].image_batch.shape == (2, 3, 64, 64)
    assert outputs[5].image_batch is not None and outputs[5].image_batch.shape == (2, 3, 160, 160)
    assert mp.generate(["still serving"], FAST)[0].ok


def test_admission_errors_keep_their_type_and_field(engines: Build) -> None:
    engine = engines(mp_config("mp-test-faults"))  # a registered name reaches the workers
    with pytest.raises(InvalidFieldError) as bad_prompt:
        engine.generate([3.5], FAST)
    assert bad_prompt.value.field == "prompt" and bad_prompt.value.value == 3.5
    with pytest.raises(InvalidFieldError) as too_tall:
        engine.generate(["x"], SamplingParams(height=1000))
    assert too_tall.value.field == "height"
    assert "FaultInjectingPipeline.height must be at most 256" in str(too_tall.value)
    with pytest.raises(InvalidFieldError, match="must be picklable") as unpicklable:
        engine.generate([threading.Lock()], FAST)
    assert unpicklable.value.field == "prompt"
    with pytest.raises(InvalidFieldError, match="must be picklable") as unpicklable_args:
        engine.generate(["x"], attrs.evolve(FAST, extra_args={"lock": threading.Lock()}))
    assert unpicklable_args.value.field == "extra_args"
    with pytest.raises(InvalidFieldError, match="nested too deeply") as deep:
        engine.generate([chain(DEEPER_THAN_PICKLE)], FAST)
    assert deep.value.field == "prompt"
    with pytest.raises(InvalidFieldError, match="nested too deeply") as deep_args:
        engine.generate(["x"], attrs.evolve(FAST, extra_args={"deep": chain(DEEPER_THAN_PICKLE)}))
    assert deep_args.value.field == "extra_args"
    assert engine.generate(["fine"], FAST)[0].ok


def test_two_workers_run_every_wave_on_every_rank_in_a_process_group(engines: Build) -> None:
    if suite_device() == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("an nccl group needs one GPU per rank; one GPU is visible")
    config = mp_config(
        num_workers=2,
        max_num_seqs=4,
        worker_extensions=(Probe,),
        init_distributed=True,
        device=suite_device(),  # on CUDA: rank r on cuda:r
    )
    engine = engines(config)
    devices = ["cpu", "cpu"] if suite_device() == "cpu" else ["cuda:0", "cuda:1"]
    assert engine.collective_rpc("device_name") == devices
    assert engine.collective_rpc("all_reduce_rank") == [1, 1]
    pids = engine.collective_rpc("pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    uni = engines(mp_config(executor_backend="uni", max_num_seqs=4))
    same_results(uni.generate(PROMPTS, PARAMS), engine.generate(PROMPTS, PARAMS))
    rank0, rank1 = engine.collective_rpc("forward_batches")
    assert rank0 == rank1  # every rank ran the same waves, fused the same way
    assert max(len(batch) for batch in rank0) > 1


def test_collective_rpc_replies_by_rank_refuses_and_times_out(
    engines: Build, tmp_path: Path
) -> None:
    engine = engines(mp_config(num_workers=2, worker_extensions=(Probe,)))
    assert engine.collective_rpc("rank") == [0, 1]
    assert engine.collective_rpc("rank", unique_reply_rank=1) == 1
    with pytest.raises(RPCError, match="not callable"):
        engine.collective_rpc("shutdown")
    with pytest.raises(RPCError, match="unique_reply_rank 2 does not exist"):
        engine.collective_rpc("rank", unique_reply_rank=2)
    with pytest.raises(ValueError, match="no good") as raised:
        engine.collective_rpc("raise_value_error", ("no good",), unique_reply_rank=1)
    assert "in worker 1" in str(raised.value.__cause__)

    flag = tmp_path / "go"
    started = time.monotonic()
    with pytest.raises(RPCError, match=r"'wait_for_file' timed out after 0\.3 s"):
        engine.collective_rpc("wait_for_file", (str(flag),), timeout=0.3)
    assert time.monotonic() - started < 5
    flag.touch()  # the workers now reply "late" to a call nobody waits for
    assert engine.collective_rpc("rank") == [0, 1]
    assert engine.collective_rpc("rank", unique_reply_rank=0) == 0
    assert engine.generate(["after the timeout"], FAST)[0].ok


def test_step_mode_streams_previews_through_shared_memory(engines: Build) -> None:
    options = dict(streaming_output=True, preview_interval=2, max_num_seqs=4)
    uni = engines(mp_config(PreviewingNoise, executor_backend="uni", **options))
    mp = engines(mp_config(PreviewingNoise, **options))

    async def stream(engine: DiffusionEngine, prompt: str, size: int) -> list[RequestOutput]:
        params = SamplingParams(num_inference_steps=5, seed=size, height=size, width=size)
        rid = await engine.add_request(prompt, params)
        return [out async for out in engine.stream(rid)]

    async def both(engine: DiffusionEngine) -> list[list[RequestOutput]]:
        # 48x48 previews travel inline, 160x160 ones through shared memory.
        return list(await asyncio.gather(stream(engine, "a", 48), stream(engine, "b", 160)))

    for expected, got in zip(asyncio.run(both(uni)), asyncio.run(both(mp)), strict=True):
        assert [(o.step, o.finished) for o in got] == [(o.step, o.finished) for o in expected]
        same_results(expected, got)
        assert sum(o.image_batch is not None for o in got) >= 3  # previews and the final image


# -- two-phase output ------------------------------------------------------------------


def test_compute_done_and_output_ready_are_handled_in_either_order(engines: Build) -> None:
    AlternatingOrder.orders.clear()
    engine = engines(mp_config(executor_backend=AlternatingOrder))
    uni = engines(mp_config(executor_backend="uni"))
    prompts = ["one", "two", "three", "four"]
    params = [SamplingParams(num_inference_steps=2, seed=s, height=40, width=40) for s in (1, 2)]
    params += [attrs.evolve(LARGE, seed=s) for s in (3, 4)]  # through shared memory
    for prompt, p in zip(prompts, params, strict=True):  # one wave each
        same_results(uni.generate([prompt], p), engine.generate([prompt], p))
    assert set(AlternatingOrder.orders) == {
        ("OutputReady", "ComputeDone"),
        ("ComputeDone", "OutputReady"),
    }


def test_waves_whose_requests_end_while_their_output_materialises_return_their_segments(
    engines: Build,
) -> None:
    """Request mode on the mp executor: while a wave's OutputReady is held back (after
    ComputeDone), requests of that wave are aborted. The executor sees only scheduler
    outputs, so it copies the wave's images like any other's; the core, where the
    aborts win, reads none of the aborted ones. In the first wave one of two requests
    is aborted and its batch mate completes with the bits a uni engine gives; the next
    five waves are aborted whole. If a lease leaked, each wave would need a new
    segment. A segment travels back to rank 0 asynchronously, so a wave may still find
    the pool empty and make a second one, never more."""
    settings = {"audit": "raise", "max_num_seqs": 2, "warmup": False}
    engine = engines(mp_config(executor_backend=HeldOutput, **settings))
    executor = engine.core.executor
    assert isinstance(executor, HeldOutput)

    async def run_wave(prompts: list[str], aborted: set[str]) -> list[RequestOutput]:
        executor.output_arrived.clear()
        executor.let_through.clear()
        engine.pause()  # all are admitted before the next step, so they share a wave
        ids = [
            await engine.add_request(p, attrs.evolve(LARGE, seed=n)) for n, p in enumerate(prompts)
        ]
        engine.resume()
        assert await asyncio.to_thread(executor.output_arrived.wait, 30)
        engine.abort([rid for rid, prompt in zip(ids, prompts, strict=True) if prompt in aborted])
        executor.let_through.set()
        finals = []
        for rid in ids:
            finals.append([o async for o in engine.stream(rid)][-1])
        return finals

    try:
        kept, aborted = asyncio.run(run_wave(["kept", "aborted"], {"aborted"}))
        for n in range(2, 7):
            [whole] = asyncio.run(run_wave([f"r{n}"], {f"r{n}"}))
            assert whole.status == RequestStatus.FINISHED_ABORTED and whole.image_batch is None
    finally:
        executor.let_through.set()
    uni = engines(mp_config(executor_backend="uni", **settings))
    same_results(uni.generate(["kept"], attrs.evolve(LARGE, seed=0)), [kept])
    assert aborted.status == RequestStatus.FINISHED_ABORTED and aborted.image_batch is None
    snapshot = engine.snapshot()
    assert not (snapshot.scheduler_ids or snapshot.runner_cached_ids)
    assert len(segment_names(executor.segment_prefix)) <= 2  # the pool, no lease
    assert engine.auditor is not None and not engine.auditor.violations


def test_an_abort_between_compute_done_and_output_ready_releases_everything(
    engines: Build,
) -> None:
    """A step-mode engine on the mp executor: while the last step's OutputReady is held
    back (after ComputeDone), one of its two requests is aborted. The abort wins, its
    batch mate completes with the bits a uni engine gives, and nothing is left for
    either: no runner state, no segment lease, no audit finding."""
    settings = {"execution_mode": "step", "audit": "raise", "max_num_seqs": 2, "warmup": False}
    engine = engines(mp_config("testing-noise", executor_backend=HeldOutput, **settings))
    executor = engine.core.executor
    assert isinstance(executor, HeldOutput)
    params = [attrs.evolve(LARGE, seed=s) for s in (1, 2)]

    async def serve() -> list[RequestOutput]:
        engine.pause()  # both are admitted before the first step, so they finish together
        ids = [
            await engine.add_request(p, q) for p, q in zip(["kept", "aborted"], params, strict=True)
        ]
        engine.resume()
        held = await asyncio.to_thread(executor.output_arrived.wait, 30)
        assert held  # between the two phases
        engine.abort(ids[1])
        executor.let_through.set()
        finals = []
        for rid in ids:
            finals.append([o async for o in engine.stream(rid)][-1])
        return finals

    try:
        kept, aborted = asyncio.run(serve())
    finally:
        executor.let_through.set()
    uni = engines(mp_config("testing-noise", executor_backend="uni", **settings))
    same_results(uni.generate(["kept"], params[0]), [kept])
    assert aborted.status == RequestStatus.FINISHED_ABORTED and aborted.image_batch is None
    snapshot = engine.snapshot()
    assert not (snapshot.scheduler_ids or snapshot.runner_cached_ids)
    assert len(segment_names(executor.segment_prefix)) <= 2  # the pool, no lease
    assert engine.auditor is not None and not engine.auditor.violations


# -- failures --------------------------------------------------------------------------


def test_a_killed_worker_fails_the_blocked_call_at_once(engines: Build, tmp_path: Path) -> None:
    config = mp_config(
        GatedPipeline,
        pipeline_kwargs={"flag_dir": str(tmp_path)},
        num_workers=2,
        worker_extensions=(Probe,),
        shutdown_grace_s=0.5,
    )
    engine = engines(config)
    pids = engine.collective_rpc("pid")
    blocked = run_in_thread(lambda: engine.generate(["gate"], FAST))
    assert wait_for(lambda: len(list(tmp_path.glob("entered-*"))) == 2)

    # Admission checks do not queue behind the running wave.
    started = time.monotonic()
    with pytest.raises(InvalidFieldError):
        engine.generate([2.5], FAST)
    assert time.monotonic() - started < 1.0

    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker 1 .* killed by SIGKILL"):
        blocked.result(5)
    assert time.monotonic() - killed < 1.0
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.generate(["after"], FAST)
    assert wait_for(lambda: not multiprocessing.active_children())


def test_a_device_fault_in_a_worker_kills_the_engine(engines: Build) -> None:
    engine = engines(mp_config())
    with pytest.raises(EngineDeadError, match="device fault on worker 0"):
        engine.generate(["device-fault"], FAST)
    with pytest.raises(EngineDeadError, match="injected device fault"):
        engine.check_health()
    assert wait_for(lambda: not multiprocessing.active_children())
    engine.close()
    engine.close()


def test_a_worker_that_fails_to_start_leaves_nothing_running() -> None:
    with pytest.raises(WorkerStartError, match="worker 1 failed to start: OSError: weights") as e:
        MultiprocExecutor(mp_config(num_workers=2, worker_extensions=(FailsOnRankOne,)))
    assert e.value.rank == 1 and isinstance(e.value.__cause__, OSError)
    assert 'raise OSError("weights not found' in str(e.value.__cause__.__cause__)  # its traceback
    assert not multiprocessing.active_children() and not child_pids()

    with pytest.raises(WorkerStartError, match=r"worker 0 .* exited with code 3 during start-up"):
        DiffusionEngine.make_engine(mp_config(exits_during_start))
    with pytest.raises(WorkerStartError, match=r"not ready after 0.1 s \(ranks still starting"):
        MultiprocExecutor(mp_config(worker_start_timeout_s=0.1))
    assert not multiprocessing.active_children() and not child_pids()


def test_pipelines_workers_cannot_import_are_refused_before_any_process_starts() -> None:
    with pytest.raises(InvalidFieldError, match="module-level factory") as lambda_factory:
        MultiprocExecutor(mp_config(lambda device: SeededNoisePipeline(device)))
    assert lambda_factory.value.field == "pipeline"
    with pytest.raises(InvalidFieldError, match="module-level factory"):
        MultiprocExecutor(mp_config(factory_of(SeededNoisePipeline("cpu"))))
    with pytest.raises(InvalidFieldError) as local_extension:
        MultiprocExecutor(mp_config(worker_extensions=(type("Local", (), {}),)))
    assert local_extension.value.field == "worker_extensions"
    with pytest.raises(InvalidFieldError, match="module-level factory"):
        MultiprocExecutor(mp_config("mp-test-lambda"))  # registered in this process only
    assert not multiprocessing.active_children()


# -- shutdown --------------------------------------------------------------------------


def test_shutdown_is_idempotent_and_runs_when_the_executor_is_dropped() -> None:
    executor = MultiprocExecutor(mp_config(worker_extensions=(Probe,)))
    assert executor.collective_rpc("rank", unique_reply_rank=0) == 0
    executor.shutdown()
    executor.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.collective_rpc("rank")
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.execute(wave(1, {"a": "x"}))
    assert not multiprocessing.active_children()

    dropped = MultiprocExecutor(mp_config())
    pid = dropped.worker_pids[0]
    del dropped
    gc.collect()
    assert not multiprocessing.active_children()
    assert not Path("/proc", str(pid)).exists()


ENGINE_PROCESS = """
import os
from diffusion_runtime import EngineConfig, SamplingParams
from diffusion_runtime.executor.mp import MultiprocExecutor
from diffusion_runtime.executor.mp.segments import segment_names
from diffusion_runtime.contracts import NewRequestData, SchedulerOutput

if __name__ == "__main__":
    executor = MultiprocExecutor(EngineConfig(pipeline="testing-noise", device="cpu"))
    large = SamplingParams(num_inference_steps=1, height=160, width=160)
    executor.execute(SchedulerOutput(1, (NewRequestData("a", "x", large, 1),), (), (), 1, 0))
    prefix = executor.segment_prefix
    print(executor.worker_pids[0], prefix, len(segment_names(prefix)), flush=True)
    os.kill(os.getpid(), 9)
"""


def test_workers_exit_and_unlink_their_segments_when_the_engine_process_dies() -> None:
    engine_process = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert engine_process.returncode == -signal.SIGKILL, engine_process.stderr
    pid, prefix, segments_before = engine_process.stdout.split()
    assert segments_before == "1"  # the pooled output segment

    def gone() -> bool:  # exited; perhaps a zombie nobody reaps in this container
        try:
            return Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    assert wait_for(gone)
    assert segment_names(prefix) == []


# -- the lifecycle harness over worker processes ----------------------------------------


def kill_rank_one(engine: DiffusionEngine) -> None:
    os.kill(engine.collective_rpc("pid")[1], signal.SIGKILL)


def harness_config() -> EngineConfig:
    # No warm-up: the harness subscribes to events after the engine is built,
    # and must not join halfway through the warm-up's waves.
    return mp_config(
        num_workers=2,
        max_num_seqs=3,
        worker_extensions=(Probe,),
        shutdown_grace_s=0.5,
        warmup=False,
    )


def harness(max_examples: int) -> type[unittest.TestCase]:
    """The lifecycle harness (auditor, cleanup, solo-run equality) with a killed worker."""
    return lifecycle_test_case(
        harness_config,
        target="front",
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing"]),
        worker_killer=kill_rank_one,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=10,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


TestLifecycleOverWorkerProcesses = harness(max_examples=2)
TestLifecycleOverWorkerProcessesAtLength = pytest.mark.slow(harness(max_examples=30))


def test_a_worker_gives_progress_bars_a_thread_lock_so_no_semaphore_is_registered() -> None:
    """tqdm's default lock (made by diffusers' loading bars in a worker) is a named
    semaphore registered with the resource tracker the worker shares with the
    engine; a worker stopped at once then leaves it for the tracker to warn about
    at exit. A worker sets a thread lock before any bar is made."""
    script = (
        "import multiprocessing.synchronize as sync\n"
        "made = []\n"
        "original = sync.SemLock.__init__\n"
        "def counted(self, *args, **kwargs):\n"
        "    made.append(1)\n"
        "    original(self, *args, **kwargs)\n"
        "sync.SemLock.__init__ = counted\n"
        "from diffusion_runtime.executor.mp import worker_proc\n"
        "worker_proc._progress_bars_without_process_locks()\n"
        "from tqdm.auto import tqdm\n"
        "for _ in tqdm(range(2), disable=False):\n"
        "    pass\n"
        "print(len(made))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.split() == ["0"], result.stderr
