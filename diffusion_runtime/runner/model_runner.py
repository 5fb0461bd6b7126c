"""ModelRunner: calls the pipeline for a scheduler output and maps results by id."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_runtime.errors import DeviceFault
from diffusion_runtime.runner.faults import is_sticky_device_fault
from diffusion_runtime.runner.output import RunnerOutput
from diffusion_runtime.runner.protocols import PipelineRequest, RequestPipeline
from diffusion_runtime.scheduler.output import SchedulerOutput


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ModelRunner:
    """Runs request-mode waves on one device.

    Every request gets its own ``torch.Generator`` seeded from its seed, and
    every result is matched to its request by id, never by position. A
    pipeline error fails only the requests of the forward that raised; a
    sticky device fault is raised as :class:`DeviceFault` for the executor.
    """

    def __init__(self, pipeline: RequestPipeline, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = device

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.release_requests(scheduler_output.finished_ids)
        result = RunnerOutput(scheduler_output.wave_id)
        batch = [
            PipelineRequest(data.request_id, data.prompt, data.params, data.seed, self.device)
            for data in scheduler_output.scheduled_new_reqs
        ]
        if not batch:
            return result
        with torch.inference_mode():
            if self.pipeline.supports_request_batch:
                self._forward(batch, result)
            else:
                for request in batch:
                    self._forward([request], result)
        return result

    def release_requests(self, request_ids: Sequence[str]) -> None:
        """Drop whatever is held for finished requests (request mode holds nothing)."""

    def cached_request_ids(self) -> list[str]:
        """Ids of requests with state held between waves."""
        return []

    def _forward(self, batch: list[PipelineRequest], result: RunnerOutput) -> None:
        try:
            produced = self.pipeline.forward(batch)
        except Exception as exc:
            if is_sticky_device_fault(exc):
                raise exc if isinstance(exc, DeviceFault) else DeviceFault(str(exc)) from exc
            message = describe_error(exc)
            for request in batch:
                result.errors[request.request_id] = message
            return
        expected = {request.request_id for request in batch}
        strays = [rid for rid in produced if rid not in expected]
        if strays:
            # A result under an id outside the batch means identity was lost:
            # trust none of this forward's results.
            message = f"pipeline returned results for ids outside its batch: {strays[:5]}"
            for request in batch:
                result.errors[request.request_id] = message
            return
        for request in batch:
            images = produced.get(request.request_id)
            problem = _check_images(images, request)
            if problem is None:
                assert images is not None
                result.images[request.request_id] = _detach_to_cpu(images)
            else:
                result.errors[request.request_id] = problem


def _check_images(images: object, request: PipelineRequest) -> str | None:
    if images is None:
        return "pipeline returned no output for this request"
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        return f"pipeline output must be a (N, C, H, W) tensor; got {type(images).__name__}"
    expected = request.params.num_outputs_per_prompt
    if images.shape[0] != expected:
        return f"pipeline returned {images.shape[0]} images; num_outputs_per_prompt is {expected}"
    return None


def _detach_to_cpu(images: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its memory: a slice of a batch must not keep the batch alive."""
    if images.requires_grad:
        images = images.detach()
    if images.device.type != "cpu":
        return images.to("cpu")
    if images._base is not None and (
        images.untyped_storage().nbytes() != images.numel() * images.element_size()
    ):
        return images.clone()
    return images
