"""The body of one worker actor: hosts a :class:`Worker` and answers the executor.

Methods in the default group run one at a time, in the order the executor
submitted them (waves and collective RPCs, like the mp worker's command loop).
Methods in the ``side`` group run on their own thread, so that an admission
check or a liveness ping never waits behind a running wave.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import attrs
import ray
import torch
import torch.distributed as dist

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.executor.mp.remote_error import RemoteError
from diffusion_runtime.executor.ray.failures import WorkerMethodError
from diffusion_runtime.executor.ray.rendezvous import StoreAddress
from diffusion_runtime.executor.ray.transport import WaveReply
from diffusion_runtime.runner.worker import Worker
from diffusion_runtime.sampling_params import SamplingParams

SIDE_GROUP = "side"


@attrs.frozen
class WorkerDescription:
    """What a started worker actor reports about itself."""

    rank: int
    node_id: str
    pid: int
    device: str
    validates: bool


class RayWorker:
    """One worker rank inside a Ray actor (created by :class:`RayWorkerGroup`)."""

    def __init__(self, config: EngineConfig, rank: int, store: StoreAddress | None) -> None:
        device = torch.device(config.device)
        if device.type == "cuda":
            # Ray shows the actor only the GPU of its bundle, as device 0.
            config = attrs.evolve(config, device="cuda:0")
        elif config.intra_op_threads is None:
            # Without this every worker on a node would use all of its cores.
            torch.set_num_threads(max(1, int(config.ray_cpus_per_worker)))
        if store is not None:
            store.join(rank, torch.device(config.device))
        self._worker = Worker(config, rank)
        self._bound_thread = threading.get_ident()

    def describe(self) -> WorkerDescription:
        worker = self._worker
        return WorkerDescription(
            rank=worker.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            device=str(worker.device),
            validates=getattr(worker.pipeline, "validate_request", None) is not None,
        )

    def execute(self, scheduler_output: SchedulerOutput, reply: bool) -> WaveReply | None:
        """Run one wave; only the output rank sends the output back."""
        output: RunnerOutput = self._call("execute_model", (scheduler_output,), {})
        return WaveReply.pack(output.settled()) if reply else None

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._call(method, args, kwargs)

    @ray.method(concurrency_group=SIDE_GROUP)
    def validate(self, prompt: Any, params: SamplingParams) -> None:
        try:
            self._worker.call("validate_request", prompt, params)
        except Exception as exc:
            raise WorkerMethodError(RemoteError.capture(exc, self._worker.rank)) from None

    @ray.method(concurrency_group=SIDE_GROUP)
    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self._worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._bound_thread != threading.get_ident():
            self._worker.bind_thread()
            self._bound_thread = threading.get_ident()
        try:
            return self._worker.call(method, *args, **kwargs)
        except Exception as exc:
            raise WorkerMethodError(RemoteError.capture(exc, self._worker.rank)) from None
