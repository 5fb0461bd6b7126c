"""What crossing a process boundary costs the mp executor, measured side by side in one run.

- ``control``: round trip of one small RPC through a real one-worker mp
  executor (caller → pipe → worker → pipe → result pump → caller), and of an
  admission check (answered by rank 0's side thread).
- ``wave``: one request-mode wave of 8 requests with ``testing-null`` (no
  compute), through ``execute``, uni against mp: the per-wave cost of IPC.
- ``image``: one 512x512x3 float32 image (3 MiB) from a child process to
  this one, through the executor's transport (packed into a pooled
  shared-memory segment, a small pickled notice over a pipe, one copy out,
  the segment handed back) against pickling it through a
  ``multiprocessing.Queue``. Both children run the same loop.
- ``throughput``: requests per second of the same engine with the ``uni``
  and the ``mp`` (one worker) executor, ``testing-noise`` pipeline at 64x64
  (short waves, a few ms) and at 128x128 with 50 steps (long waves), the two
  engines measured in alternation so that load drift hits both.
- ``death``: from ``SIGKILL`` of a worker to the failure callback, and to the
  ``EngineDeadError`` of a caller blocked in ``execute``.
- ``hang``: from ``SIGSTOP`` of a worker to the ``EngineDeadError`` of a
  caller blocked in ``execute`` (bounded by ``worker_liveness_timeout_s``),
  and how long ``shutdown()`` then takes.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from typing import Any

import torch

from diffusion_runtime.bench import interleaved_generate_rates
from diffusion_runtime.bench.stats import Stopwatch, call_seconds, summary_us
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import NewRequestData, RunnerOutput, SchedulerOutput
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import EngineDeadError
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.executor.mp import MultiprocExecutor
from diffusion_runtime.executor.mp.messages import OutputReady, ReleaseSegment, dumps, loads
from diffusion_runtime.executor.mp.segments import SEGMENT_PREFIX, OutputArena, OutputReader
from diffusion_runtime.executor.uni import UniProcExecutor
from diffusion_runtime.sampling_params import SamplingParams

IMAGE_SHAPE = (1, 3, 512, 512)


# -- control messages ------------------------------------------------------------------


def control_round_trip(executor: MultiprocExecutor, count: int) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=1)
    rpc = call_seconds(
        lambda: executor.collective_rpc("check_health", unique_reply_rank=0), count, 50
    )
    validate = call_seconds(lambda: executor.validate_request("a prompt", params), count, 50)
    return {"rpc": summary_us(rpc), "validate_request": summary_us(validate), "samples": count}


# -- one image -------------------------------------------------------------------------


def _shm_image_child(requests: Connection, replies: Connection, prefix: str) -> None:
    image = torch.rand(IMAGE_SHAPE)
    arena = OutputArena(prefix)
    try:
        while (message := loads(requests.recv_bytes())) is not None:
            if isinstance(message, ReleaseSegment):
                arena.release(message.name)
                continue
            segment, slots, retired = arena.pack([("images", "r", image)])
            ready = OutputReady(0, RunnerOutput(0), segment, b"", slots, retired)
            replies.send_bytes(dumps(ready))
    finally:
        arena.close()


def _queue_image_child(requests: Queue[bool | None], replies: Queue[Any]) -> None:
    image = torch.rand(IMAGE_SHAPE).numpy()
    while requests.get() is not None:
        replies.put(image)


def image_round_trip(count: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    nbytes = int(torch.Size(IMAGE_SHAPE).numel()) * 4

    child_requests, to_child = context.Pipe(duplex=False)
    from_child, child_replies = context.Pipe(duplex=False)
    prefix = f"{SEGMENT_PREFIX}{os.getpid()}-bench-"
    shm_child = context.Process(
        target=_shm_image_child, args=(child_requests, child_replies, prefix), daemon=True
    )
    requests: Queue[bool | None] = context.Queue()
    replies: Queue[Any] = context.Queue()
    queue_child = context.Process(target=_queue_image_child, args=(requests, replies), daemon=True)
    shm_child.start()
    queue_child.start()
    child_requests.close()
    child_replies.close()
    reader = OutputReader()

    def through_shared_memory() -> None:
        to_child.send_bytes(dumps(True))
        ready: OutputReady = loads(from_child.recv_bytes())
        image = reader.copy_out(ready.segment, ready.inline, ready.slots)["images"]["r"]
        assert image.shape == IMAGE_SHAPE
        assert ready.segment is not None
        to_child.send_bytes(dumps(ReleaseSegment(ready.segment)))

    def through_queue() -> None:
        requests.put(True)
        image = torch.from_numpy(replies.get())
        assert image.shape == IMAGE_SHAPE

    try:
        shm = call_seconds(through_shared_memory, count, 20)
        pickled = call_seconds(through_queue, count, 20)
    finally:
        to_child.send_bytes(dumps(None))
        requests.put(None)
        shm_child.join()
        queue_child.join()
        reader.close()
        to_child.close()
        from_child.close()
        requests.close()
        replies.close()
    return {
        "shape": list(IMAGE_SHAPE),
        "dtype": "float32",
        "bytes": nbytes,
        "shared_memory": summary_us(shm),
        "mp_queue_pickle": summary_us(pickled),
        "speedup": round(statistics.median(pickled) / statistics.median(shm), 2),
        "samples": count,
    }


# -- engine throughput -----------------------------------------------------------------


def wave_overhead(count: int) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=1)
    numbers = itertools.count()

    def next_wave() -> SchedulerOutput:
        i = next(numbers)
        new = tuple(NewRequestData(f"{i}-{k}", "p", params, k) for k in range(8))
        return SchedulerOutput(i, new, (), (), 8, 0)

    results: dict[str, Any] = {"requests_per_wave": 8, "pipeline": "testing-null"}
    for backend, cls in (("uni", UniProcExecutor), ("mp", MultiprocExecutor)):
        executor = cls(EngineConfig(pipeline="testing-null", device="cpu"))
        try:
            results[backend] = summary_us(
                call_seconds(functools.partial(_execute_next, executor, next_wave), count, 50)
            )
        finally:
            executor.shutdown()
    return results


def _execute_next(executor: DiffusionExecutor, next_wave: Callable[[], SchedulerOutput]) -> None:
    executor.execute(next_wave())


def engine_throughput(
    num_requests: int, repeats: int, size: int = 64, steps: int = 10
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps, seed=0, height=size, width=size)
    prompts = [f"p{i}" for i in range(num_requests)]
    engines = {
        backend: DiffusionEngine.make_engine(
            EngineConfig(
                pipeline="testing-noise", device="cpu", executor_backend=backend, max_num_seqs=8
            )
        )
        for backend in ("uni", "mp")
    }
    try:
        for engine in engines.values():
            engine.generate(prompts[:16], params)
        rates = interleaved_generate_rates(engines, prompts, params, repeats)
    finally:
        for engine in engines.values():
            engine.close()
    uni, mp = rates["uni"], rates["mp"]
    return {
        "requests": num_requests,
        "pipeline": f"testing-noise {size}x{size}, {steps} steps, max_num_seqs 8",
        "uni_requests_per_s": round(uni, 1),
        "mp_requests_per_s": round(mp, 1),
        "mp_over_uni": round(mp / uni, 3),
    }


# -- death detection -------------------------------------------------------------------


def death_detection(executor: MultiprocExecutor) -> dict[str, Any]:
    """Kill the worker under a blocked ``execute``; time what the engine would see."""
    clock = Stopwatch()
    failed = threading.Event()
    failed_at: list[float] = []

    def on_failure(reason: str) -> None:
        failed_at.append(clock.seconds())
        failed.set()

    executor.add_failure_callback(on_failure)
    params = SamplingParams(num_inference_steps=1, seed=0)
    gated = SchedulerOutput(1, (NewRequestData("g", "gate", params, 0),), (), (), 1, 0)
    raised_at: list[float] = []
    dispatched = threading.Event()

    def blocked_caller() -> None:
        dispatched.set()
        try:
            executor.execute(gated)
        except EngineDeadError:
            raised_at.append(clock.seconds())

    caller = threading.Thread(target=blocked_caller)
    caller.start()
    dispatched.wait()
    time.sleep(0.2)  # let the wave reach the worker's gate
    killed_at = clock.seconds()
    os.kill(executor.worker_pids[0], signal.SIGKILL)
    caller.join(10)
    failed.wait(10)
    return {
        "to_blocked_caller_ms": round((raised_at[0] - killed_at) * 1e3, 2),
        "to_failure_callbacks_ms": round((failed_at[0] - killed_at) * 1e3, 2),
    }


def hang_detection(liveness_s: float = 1.0) -> dict[str, Any]:
    """Stop the worker under a blocked ``execute``; time until the caller is answered."""
    config = EngineConfig(
        pipeline="testing-faults",
        device="cpu",
        executor_backend="mp",
        worker_liveness_timeout_s=liveness_s,
        shutdown_grace_s=1.0,
    )
    executor = MultiprocExecutor(config)
    pid = executor.worker_pids[0]
    params = SamplingParams(num_inference_steps=1, seed=0)
    gated = SchedulerOutput(1, (NewRequestData("g", "gate", params, 0),), (), (), 1, 0)
    clock = Stopwatch()
    raised_at: list[float] = []

    def blocked_caller() -> None:
        try:
            executor.execute(gated)
        except EngineDeadError:
            raised_at.append(clock.seconds())

    caller = threading.Thread(target=blocked_caller)
    try:
        caller.start()
        time.sleep(0.2)  # let the wave reach the worker's gate
        stopped_at = clock.seconds()
        os.kill(pid, signal.SIGSTOP)
        caller.join(liveness_s + 10)
    finally:
        shutdown = Stopwatch()
        executor.shutdown()
        shutdown_s = shutdown.seconds()
    return {
        "liveness_timeout_s": liveness_s,
        "to_blocked_caller_s": round(raised_at[0] - stopped_at, 3),
        "shutdown_s": round(shutdown_s, 3),
    }


def run(
    control_samples: int = 2_000,
    wave_samples: int = 500,
    image_samples: int = 200,
    throughput_requests: int = 512,
    throughput_repeats: int = 5,
) -> dict[str, Any]:
    config = EngineConfig(pipeline="testing-faults", device="cpu", executor_backend="mp")
    results: dict[str, Any] = {"benchmark": "ipc", "torch_threads": torch.get_num_threads()}
    executor = MultiprocExecutor(config)
    try:
        results["control"] = control_round_trip(executor, control_samples)
        results["death"] = death_detection(executor)
    finally:
        executor.shutdown()
    results["hang"] = hang_detection()
    results["wave"] = wave_overhead(wave_samples)
    results["image"] = image_round_trip(image_samples)
    results["throughput"] = engine_throughput(throughput_requests, throughput_repeats)
    # Longer waves (about 100 ms here), closer to a real model's: the per-wave cost shrinks.
    results["throughput_long_waves"] = engine_throughput(
        throughput_requests // 8, throughput_repeats, size=128, steps=50
    )
    return results
