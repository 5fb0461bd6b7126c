"""What returning RL trajectories costs against images only, measured side by side in one run.

``requests`` digits prompts of ``steps`` stochastic DDIM steps (``eta`` 1:
DDPM's variance) run as one ``generate`` call, step mode, all in one step
batch (``max_num_seqs=requests``, one torch thread), in two ways:
``images`` (images only) and ``full`` (``return_trajectory="full"``: images,
every step's latents and every sampled step's log-probability). Both ways
draw the same noise, so they do the same sampling work. Each runs in process
(a :class:`DiffusionEngine`) and through the stage (a :class:`StageClient`),
the four ways interleaved round by round after one untimed round, so load
drift hits all of them.

Reported per place: the median and the fastest wall time of the call (and
the median per request); in process also the median CPU time of the thread
that ran the engine, which a busy machine disturbs far less; the bytes each
request's output carries (its image tensor; plus the trajectory's latents
and log-probs); and ``full / images`` ratios. Through the stage, also the
bytes that reached the client's socket per request (every frame of every
reply, counted as it arrives), split into msgpack headers and raw tensor
frames: the trajectory's tensors cross as raw frames, so a header grows only
by the trajectory's step numbers and tensor layouts.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import torch
import zmq

from diffusion_runtime.bench.stats import Stopwatch
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.stage import StageClient

WAYS = ("images", "full")
PLACES = ("in_process", "stage")

#: One way's ``generate`` call: its outputs, and the CPU seconds of the thread that
#: ran the engine where that is measurable (in process).
_Call = Callable[[], Awaitable[tuple[list[RequestOutput], float | None]]]


@attrs.define
class _FrameCounter:
    """Bytes of the replies a client received: headers and raw tensor frames."""

    header_bytes: int = 0
    raw_bytes: int = 0

    def add(self, frames: list[zmq.Frame]) -> None:
        self.header_bytes += len(frames[0])
        self.raw_bytes += sum(len(frame) for frame in frames[1:])

    def take(self) -> tuple[int, int]:
        counted = (self.header_bytes, self.raw_bytes)
        self.header_bytes = self.raw_bytes = 0
        return counted


class _CountingClient(StageClient):
    """A stage client that counts every frame it receives."""

    def __init__(self, config: EngineConfig, counter: _FrameCounter) -> None:
        super().__init__(config)
        self._counter = counter

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        self._counter.add(frames)
        super()._dispatch(frames)


def way_params(requests: int, steps: int, eta: float) -> dict[str, list[SamplingParams]]:
    """Each way's params, one per request (seed ``i`` for request ``i``)."""
    images = [
        SamplingParams(num_inference_steps=steps, seed=seed, extra_args={"eta": eta})
        for seed in range(requests)
    ]
    return {
        "images": images,
        "full": [attrs.evolve(params, return_trajectory="full") for params in images],
    }


def output_bytes(output: RequestOutput) -> int:
    """The bytes of the tensors an output carries: images, latents, trajectory."""
    tensors = [output.image_batch, output.latents]
    if output.trajectory is not None:
        tensors += [output.trajectory.latents, output.trajectory.log_probs]
    return sum(tensor.nbytes for tensor in tensors if tensor is not None)


def run(requests: int = 64, steps: int = 20, rounds: int = 15, eta: float = 1.0) -> dict[str, Any]:
    """The table described above; about 40 s at the defaults on 2 CPU cores."""
    if requests < 1 or rounds < 1:
        raise ValueError(f"requests and rounds must be at least 1; got {requests}, {rounds}")
    # One torch thread: on a shared machine a thread team's timings swing far more.
    config = EngineConfig(
        pipeline="digits",
        device="cpu",
        execution_mode="step",
        max_num_seqs=requests,
        intra_op_threads=1,
    )
    prompts = [str(i % 10) for i in range(requests)]
    params = way_params(requests, steps, eta)
    result: dict[str, Any] = {
        "benchmark": "rl",
        "pipeline": "digits",
        "requests": requests,
        "steps": steps,
        "eta": eta,
        "rounds": rounds,
    }
    result.update(asyncio.run(_measure(config, prompts, params, rounds)))
    return result


async def _measure(
    config: EngineConfig,
    prompts: list[str],
    params: dict[str, list[SamplingParams]],
    rounds: int,
) -> dict[str, Any]:
    counter = _FrameCounter()
    seconds: dict[tuple[str, str], list[float]] = {}
    cpu_seconds: dict[str, list[float]] = {}
    last: dict[tuple[str, str], list[RequestOutput]] = {}
    socket: dict[str, tuple[int, int]] = {}
    with DiffusionEngine.make_engine(config) as engine:
        async with _CountingClient(config, counter) as client:
            calls: dict[tuple[str, str], _Call] = {}
            for way in WAYS:
                calls["in_process", way] = _in_process(engine, prompts, params[way])
                calls["stage", way] = _through_stage(client, prompts, params[way])
            for index in range(rounds + 1):  # round 0 warms every way up, untimed
                for key, call in calls.items():
                    counter.take()
                    watch = Stopwatch()
                    outputs, cpu = await call()
                    elapsed = watch.seconds()
                    if key[0] == "stage":
                        socket[key[1]] = counter.take()
                    if index:
                        seconds.setdefault(key, []).append(elapsed)
                        if cpu is not None:
                            cpu_seconds.setdefault(key[1], []).append(cpu)
                    last[key] = outputs
    for outputs in last.values():
        failed = [output.error for output in outputs if not output.ok]
        if failed:
            raise RuntimeError(f"a benchmark request failed: {failed[0]}")
    same = all(
        _same_trajectory(mine, theirs)
        for mine, theirs in zip(last["stage", "full"], last["in_process", "full"], strict=True)
    )
    count = len(prompts)
    table: dict[str, Any] = {}
    for place in PLACES:
        row: dict[str, Any] = {}
        for way in WAYS:
            median_s = statistics.median(seconds[place, way])
            row[way] = {
                "median_ms": round(median_s * 1e3, 1),
                "median_ms_per_request": round(median_s * 1e3 / count, 3),
                "fastest_ms": round(min(seconds[place, way]) * 1e3, 1),
                "output_bytes_per_request": _per_request(last[place, way]),
            }
            if place == "in_process":
                row[way]["median_cpu_ms"] = round(statistics.median(cpu_seconds[way]) * 1e3, 1)
            else:
                header, raw = socket[way]
                row[way]["socket_bytes_per_request"] = {
                    "headers": round(header / count),
                    "raw_frames": round(raw / count),
                }
        row["full_over_images"] = {
            "time": _ratio(row, "median_ms"),
            "fastest_time": _ratio(row, "fastest_ms"),
            **({"cpu_time": _ratio(row, "median_cpu_ms")} if place == "in_process" else {}),
            "output_bytes": round(
                row["full"]["output_bytes_per_request"] / row["images"]["output_bytes_per_request"],
                2,
            ),
        }
        table[place] = row
    table["stage_trajectories_equal_in_process"] = same
    return table


def _ratio(row: dict[str, Any], figure: str) -> float:
    ratio: float = row["full"][figure] / row["images"][figure]
    return round(ratio, 3)


def _same_trajectory(mine: RequestOutput, theirs: RequestOutput) -> bool:
    """Whether two outputs carry the same trajectory tensors, bit for bit."""
    a, b = mine.trajectory, theirs.trajectory
    if a is None or b is None or a.log_probs is None or b.log_probs is None:
        return False
    return torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)


def _per_request(outputs: list[RequestOutput]) -> int:
    return round(statistics.mean(output_bytes(output) for output in outputs))


def _in_process(engine: DiffusionEngine, prompts: list[str], params: list[SamplingParams]) -> _Call:
    def generate() -> tuple[list[RequestOutput], float]:
        watch = Stopwatch(time.thread_time)
        outputs = engine.generate(prompts, params)
        return outputs, watch.seconds()

    async def call() -> tuple[list[RequestOutput], float | None]:
        # The blocking call drives the core on a worker thread (all of the engine's
        # work, with one torch thread), so the stage client's receive loop keeps
        # running on this one.
        return await asyncio.to_thread(generate)

    return call


def _through_stage(client: StageClient, prompts: list[str], params: list[SamplingParams]) -> _Call:
    async def call() -> tuple[list[RequestOutput], float | None]:
        return await client.generate(prompts, params), None

    return call
