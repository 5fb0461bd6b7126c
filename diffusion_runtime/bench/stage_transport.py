"""What authenticated TCP costs against IPC, measured side by side in one run.

- ``round_trip``: one-request ``generate`` calls through two stages with the
  same config, one over IPC and one over CURVE-authenticated TCP, alternating
  call by call so that load drift hits both. Pipeline ``digits``, request mode.
- ``image``: one 512x512x3 float32 image (3 MiB) as the stage frames it (a
  header and a raw second frame) through a PUSH/PULL pair inside one process:
  over IPC, over plain loopback TCP, and over loopback TCP with the stage's
  CURVE setup (the encryption of every byte is the difference).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import zmq

from diffusion_runtime.bench.stats import Stopwatch, interleaved_seconds, summary_us
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.stage import StageClient
from diffusion_runtime.stage.codec import output_to_frames
from diffusion_runtime.stage.endpoints import bind
from diffusion_runtime.stage.messages import encode
from diffusion_runtime.stage.security import launch_identities, serve_only_peer, trust_only_peer

IMAGE_SHAPE = (1, 3, 512, 512)
LOOPBACK_TCP = "tcp://127.0.0.1:*"


async def round_trip(steps: int, repeats: int) -> dict[str, Any]:
    config = EngineConfig(pipeline="digits", device="cpu")
    params = SamplingParams(num_inference_steps=steps, seed=0)
    async with StageClient(config) as ipc, StageClient(config, transport="tcp") as tcp:
        samples: dict[str, list[float]] = {"ipc": [], "tcp_curve": []}
        for index in range(repeats + 3):
            for name, client in (("ipc", ipc), ("tcp_curve", tcp)):
                watch = Stopwatch()
                [output] = await client.generate(["7"], params)
                assert output.ok
                if index >= 3:  # the first calls warm both paths up
                    samples[name].append(watch.seconds())
    ipc_us, tcp_us = summary_us(samples["ipc"]), summary_us(samples["tcp_curve"])
    return {
        "pipeline": "digits",
        "num_inference_steps": steps,
        "ipc": ipc_us,
        "tcp_curve": tcp_us,
        "tcp_curve_over_ipc": round(tcp_us["median_us"] / ipc_us["median_us"], 3),
        "repeats": repeats,
    }


def _trips(
    receiver: zmq.Socket[Any], sender: zmq.Socket[Any], address: str, frames: list[Any]
) -> Callable[[], None]:
    """One trip of ``frames`` from ``sender`` to ``receiver`` (bound at ``address``)."""
    sender.connect(bind(receiver, address))

    def trip() -> None:
        sender.send_multipart(frames, copy=False)
        received = receiver.recv_multipart(copy=False)
        assert len(received[-1]) == len(frames[-1])

    return trip


def image_trips(count: int) -> dict[str, Any]:
    output = RequestOutput(
        request_id="bench",
        status=RequestStatus.FINISHED_COMPLETED,
        finished=True,
        image_batch=torch.rand(IMAGE_SHAPE),
        seed=0,
    )
    result, [payload] = output_to_frames(output)
    frames: list[Any] = [encode(result), payload]
    kinds = ("ipc", "tcp", "tcp_curve")
    # Each side has a context of its own, as the client and the stage do.
    receiving: zmq.Context[Any] = zmq.Context()
    sending: zmq.Context[Any] = zmq.Context()
    guard = None
    try:
        with tempfile.TemporaryDirectory(prefix="diffusion-stage-bench-") as tmp:
            sockets = {
                kind: (receiving.socket(zmq.PULL), sending.socket(zmq.PUSH)) for kind in kinds
            }
            receiver_identity, sender_identity = launch_identities()
            guard = serve_only_peer(receiving, sockets["tcp_curve"][0], receiver_identity)
            trust_only_peer(sockets["tcp_curve"][1], sender_identity)
            addresses = {
                "ipc": f"ipc://{tmp}/image",
                "tcp": LOOPBACK_TCP,
                "tcp_curve": LOOPBACK_TCP,
            }
            trips = {kind: _trips(*sockets[kind], addresses[kind], frames) for kind in kinds}
            # The first rounds warm each pair up.
            samples = interleaved_seconds(trips, count, warmup_rounds=3)
    finally:
        if guard is not None:
            guard.close()
        sending.destroy(linger=0)
        receiving.destroy(linger=0)
    summaries = {kind: summary_us(samples[kind]) for kind in kinds}
    return {
        "nbytes": payload.nbytes,
        **summaries,
        "tcp_curve_over_tcp": round(
            summaries["tcp_curve"]["median_us"] / summaries["tcp"]["median_us"], 3
        ),
        "tcp_curve_over_ipc": round(
            summaries["tcp_curve"]["median_us"] / summaries["ipc"]["median_us"], 3
        ),
        "samples": count,
    }


def run(steps: int = 2, repeats: int = 100, image_samples: int = 100) -> dict[str, Any]:
    """Both measurements; the default run takes about 20 s on 2 CPU cores."""
    return {
        "benchmark": "stage-transport",
        "round_trip": asyncio.run(round_trip(steps, repeats)),
        "image": image_trips(image_samples),
    }
