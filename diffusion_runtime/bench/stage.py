"""What running the engine in a stage process costs, measured side by side in one run.

- ``round_trip``: the same requests through a :class:`StageClient` (client →
  stage → engine → client) and through an in-process engine with the same
  config, both driven from one event loop with the async API, alternating
  request by request so that load drift hits both. ``single`` sends one
  request at a time (latency); ``burst`` sends ``burst`` prompts in one
  ``generate`` call (one message per prompt), ``batch`` the same prompts as
  one ``add_batch_request`` (one message), both as cost per request; the
  in-process side admits the prompts one after the other. Pipeline
  ``digits``, request mode.
- ``image``: one 512x512x3 float32 image output (3 MiB). ``codec`` is the
  encode + decode cost of its Result message with the image as a raw second
  frame (the stage's framing, zero-copy both ways) against the image as
  ``bytes`` inside the msgspec struct (one copy each way, plus one to make the
  decoded tensor writable); ``socket`` adds the trip through a real ZMQ
  PUSH/PULL pair over IPC, inside one process.
- ``throughput``: images per second of ``generate`` on digits through a
  :class:`StageClient` against the blocking in-process
  ``DiffusionEngine.generate`` (which drives the core on the caller's thread),
  timed in interleaved rounds at each batch size. Only public API is used, so
  the same function measures an older build side by side with this one.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import torch
import zmq

from diffusion_runtime.bench.stats import Stopwatch, call_seconds, summary_us
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.stage import StageClient
from diffusion_runtime.stage.codec import output_from_frames, output_to_frames
from diffusion_runtime.stage.messages import Result, decode_from_stage, encode

IMAGE_SHAPE = (1, 3, 512, 512)


# -- round trip ------------------------------------------------------------------------


async def _through_engine(
    engine: DiffusionEngine, prompts: list[str], params: SamplingParams
) -> None:
    ids = [await engine.add_request(prompt, params) for prompt in prompts]
    for request_id in ids:
        async for output in engine.stream(request_id):
            assert not output.finished or output.ok


async def _generate(client: StageClient, prompts: list[str], params: SamplingParams) -> None:
    outputs = await client.generate(prompts, params)
    assert all(output.ok for output in outputs)


async def _batch(client: StageClient, prompts: list[str], params: SamplingParams) -> None:
    output = await client.add_batch_request(prompts, params)
    assert output.ok


async def _side_by_side(
    client: StageClient,
    through_stage: Callable[[StageClient, list[str], SamplingParams], Awaitable[None]],
    engine: DiffusionEngine,
    prompts: list[str],
    params: SamplingParams,
    repeats: int,
) -> dict[str, Any]:
    stage_s: list[float] = []
    local_s: list[float] = []
    for _ in range(repeats):
        watch = Stopwatch()
        await through_stage(client, prompts, params)
        stage_s.append(watch.seconds() / len(prompts))
        watch = Stopwatch()
        await _through_engine(engine, prompts, params)
        local_s.append(watch.seconds() / len(prompts))
    stage, local = summary_us(stage_s), summary_us(local_s)
    return {
        "prompts_per_call": len(prompts),
        "stage_per_request": stage,
        "in_process_per_request": local,
        "overhead_us_per_request": round(stage["median_us"] - local["median_us"], 1),
        "stage_over_in_process": round(stage["median_us"] / local["median_us"], 3),
        "repeats": repeats,
    }


async def round_trip(steps: int, repeats: int, burst: int) -> dict[str, Any]:
    config = EngineConfig(pipeline="digits", device="cpu", max_num_seqs=burst)
    params = SamplingParams(num_inference_steps=steps, seed=0)
    async with StageClient(config) as client:
        with DiffusionEngine.make_engine(config) as engine:
            prompts = [str(d % 10) for d in range(burst)]
            await _side_by_side(client, _generate, engine, prompts, params, 3)
            bursts = max(3, repeats // 10)
            return {
                "pipeline": "digits",
                "num_inference_steps": steps,
                "single": await _side_by_side(client, _generate, engine, ["7"], params, repeats),
                "burst": await _side_by_side(client, _generate, engine, prompts, params, bursts),
                "batch": await _side_by_side(client, _batch, engine, prompts, params, bursts),
            }


# -- throughput -----------------------------------------------------------------------


async def throughput(
    steps: int = 10, batch_sizes: tuple[int, ...] = (1, 8, 32), repeats: int = 5
) -> dict[str, Any]:
    """Images/s through the stage and in process (blocking ``generate``), interleaved."""
    largest = max(batch_sizes)
    # One torch thread each: two processes whose thread teams spin on 2 cores slow
    # each other down far more than the stage itself costs.
    config = EngineConfig(pipeline="digits", device="cpu", max_num_seqs=largest, intra_op_threads=1)
    params = SamplingParams(num_inference_steps=steps, seed=0)
    rows = []
    async with StageClient(config) as client:
        with DiffusionEngine.make_engine(config) as engine:
            for size in batch_sizes:
                prompts = [str(d % 10) for d in range(size)]
                stage_rates: list[float] = []
                local_rates: list[float] = []
                for _ in range(repeats):
                    watch = Stopwatch()
                    outputs = await client.generate(prompts, params)
                    stage_rates.append(size / watch.seconds())
                    assert all(o.ok for o in outputs)
                    watch = Stopwatch()
                    outputs = engine.generate(prompts, params)
                    local_rates.append(size / watch.seconds())
                    assert all(o.ok for o in outputs)
                stage, local = statistics.median(stage_rates), statistics.median(local_rates)
                rows.append(
                    {
                        "batch": size,
                        "stage_images_per_s": round(stage, 1),
                        "in_process_images_per_s": round(local, 1),
                        "stage_over_in_process": round(stage / local, 3),
                    }
                )
    return {"pipeline": "digits", "num_inference_steps": steps, "repeats": repeats, "rows": rows}


# -- one image ---------------------------------------------------------------------------


class _ResultWithBytes(msgspec.Struct, frozen=True):
    """The alternative framing: the image bytes inside the message."""

    result: Result
    image: bytes


def _image_output() -> RequestOutput:
    return RequestOutput(
        request_id="bench",
        status=RequestStatus.FINISHED_COMPLETED,
        finished=True,
        image_batch=torch.rand(IMAGE_SHAPE),
        seed=0,
    )


def image_costs(count: int) -> dict[str, Any]:
    output = _image_output()
    warmup = max(3, count // 10)
    bytes_decoder = msgspec.msgpack.Decoder(_ResultWithBytes)

    def two_frames_encode() -> list[Any]:
        result, payloads = output_to_frames(output)
        return [encode(result), *payloads]

    def bytes_encode() -> bytes:
        result, [payload] = output_to_frames(output)
        return msgspec.msgpack.encode(_ResultWithBytes(result, payload.tobytes()))

    def bytes_decode(data: bytes) -> torch.Tensor:
        message = bytes_decoder.decode(data)
        assert message.result.image is not None
        flat = torch.frombuffer(bytearray(message.image), dtype=torch.float32)
        return flat.view(message.result.image.shape)

    header, payload = two_frames_encode()
    frame = zmq.Frame(payload)
    encoded = bytes_encode()

    def two_frames_decode() -> torch.Tensor:
        result = decode_from_stage(header)
        assert isinstance(result, Result)
        images = output_from_frames(result, [frame]).image_batch
        assert images is not None
        return images

    codec = {
        "two_frames": {
            "encode": summary_us(call_seconds(two_frames_encode, count, warmup)),
            "decode": summary_us(call_seconds(two_frames_decode, count, warmup)),
        },
        "bytes_in_struct": {
            "encode": summary_us(call_seconds(bytes_encode, count, warmup)),
            "decode": summary_us(call_seconds(lambda: bytes_decode(encoded), count, warmup)),
        },
    }
    assert torch.equal(two_frames_decode(), bytes_decode(encoded))
    with tempfile.TemporaryDirectory(prefix="diffusion-stage-bench-") as tmp:
        ctx = zmq.Context()
        try:
            receiver = ctx.socket(zmq.PULL)
            sender = ctx.socket(zmq.PUSH)
            receiver.bind(f"ipc://{tmp}/image")
            sender.connect(f"ipc://{tmp}/image")

            def two_frames_trip() -> torch.Tensor:
                sender.send_multipart(two_frames_encode(), copy=False)
                frames = receiver.recv_multipart(copy=False)
                result = decode_from_stage(frames[0].buffer)
                assert isinstance(result, Result)
                images = output_from_frames(result, frames[1:]).image_batch
                assert images is not None
                return images

            def bytes_trip() -> torch.Tensor:
                sender.send(bytes_encode(), copy=False)
                return bytes_decode(receiver.recv(copy=False).bytes)

            socket = {
                "two_frames": summary_us(call_seconds(two_frames_trip, count, warmup)),
                "bytes_in_struct": summary_us(call_seconds(bytes_trip, count, warmup)),
            }
        finally:
            ctx.destroy(linger=0)
    return {
        "shape": list(IMAGE_SHAPE),
        "dtype": "float32",
        "nbytes": output.image_batch.nbytes if output.image_batch is not None else 0,
        "codec": codec,
        "socket": socket,
        "samples": count,
    }


def run(
    steps: int = 2, repeats: int = 200, burst: int = 16, image_samples: int = 200
) -> dict[str, Any]:
    """Both measurements; the default run takes well under a minute on 2 CPU cores."""
    return {
        "benchmark": "stage",
        "round_trip": asyncio.run(round_trip(steps, repeats, burst)),
        "throughput": asyncio.run(throughput()),
        "image": image_costs(image_samples),
    }
