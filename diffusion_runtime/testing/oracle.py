"""The direct oracle: a request's images computed by calling the pipeline
itself, outside the engine, so a bug in the runtime's path cannot hide in both
sides of the comparison."""

from __future__ import annotations

from typing import Any

import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.pipelines.protocols import PipelineRequest, forward_by_steps
from diffusion_runtime.pipelines.registry import build_pipeline
from diffusion_runtime.runner.worker import worker_device
from diffusion_runtime.sampling_params import SamplingParams

#: The request id of the oracle's direct calls.
ORACLE_ID = "oracle"


class DirectOracle:
    """Runs one request at a time through the pipeline on the test's thread:
    ``forward`` in request mode, the step methods (``forward_by_steps``) in step mode.

    ``seed_free`` is the pipeline's own declaration (an optional
    ``seed_free = True`` attribute) that its outputs do not depend on the seed.
    """

    def __init__(self, pipeline: Any, device: torch.device, *, step_mode: bool = False) -> None:
        self.pipeline = pipeline
        self.device = device
        self.step_mode = step_mode
        self.seed_free = bool(getattr(pipeline, "seed_free", False))

    @classmethod
    def for_config(cls, config: EngineConfig) -> DirectOracle:
        """A fresh pipeline built the way a worker of ``config`` builds its own."""
        device = worker_device(config, 0)
        pipeline = build_pipeline(config.pipeline, device, config.pipeline_kwargs)
        return cls(pipeline, device, step_mode=config.resolved_mode == "step")

    def images(self, prompt: Any, params: SamplingParams, seed: int) -> torch.Tensor | None:
        """The pipeline's images for one request alone, or ``None`` when it fails it."""
        request = PipelineRequest(ORACLE_ID, prompt, params, seed, self.device)
        try:
            with torch.inference_mode():
                if self.step_mode:
                    produced = forward_by_steps(self.pipeline, [request])
                else:
                    produced = self.pipeline.forward([request])
        except Exception:
            return None
        finally:
            release = getattr(self.pipeline, "release_requests", None)
            if callable(release):  # the engine may share this pipeline object
                release([ORACLE_ID])
        images = produced.get(ORACLE_ID)
        if not isinstance(images, torch.Tensor):
            return None
        return images.detach().to("cpu")

    def matches(self, expected: torch.Tensor, actual: torch.Tensor, tolerance: float) -> bool:
        """Whether two image batches are equal (within ``tolerance``, absolute)."""
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            return False
        if tolerance == 0.0:
            return torch.equal(expected, actual)
        return torch.allclose(expected, actual, rtol=0.0, atol=tolerance)
