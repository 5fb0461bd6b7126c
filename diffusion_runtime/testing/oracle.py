"""The direct oracle: a request's images computed by calling the pipeline
itself, outside the engine, so a bug in the runtime's path cannot hide in both
sides of the comparison."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch

from diffusion_runtime.cache_settings import effective_cache
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepPipeline, forward_by_steps
from diffusion_runtime.pipelines.registry import build_pipeline
from diffusion_runtime.runner.worker import worker_device
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.trajectory import SampledOutput, TrajectoryTensors

#: The request id of the oracle's direct calls.
ORACLE_ID = "oracle"

Result = TypeVar("Result")


class FailureScope(enum.Enum):
    """Whom the pipeline fails when it runs a request: nobody, the request alone,
    or every request of the batch it runs in."""

    NONE = "none"
    OWN = "own"
    BATCH = "batch"


class DirectOracle:
    """Runs one request at a time through the pipeline on the test's thread:
    ``forward`` in request mode, the step methods (``forward_by_steps``) in step mode.

    ``seed_free`` is the pipeline's own declaration (an optional
    ``seed_free = True`` attribute) that its outputs do not depend on the seed.
    ``cache_backend`` and ``cache_config`` are the engine's step cache: each
    request runs with them overridden by its own ``SamplingParams.cache``, as
    in the engine, except that a threshold of 0 runs uncached: the engine's
    output must then equal the uncached one bit for bit.
    """

    def __init__(
        self,
        pipeline: Any,
        device: torch.device,
        *,
        step_mode: bool = False,
        cache_backend: str | None = None,
        cache_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.device = device
        self.step_mode = step_mode
        self.seed_free = bool(getattr(pipeline, "seed_free", False))
        self.cache_backend = cache_backend
        self.cache_config = dict(cache_config or {})

    @classmethod
    def for_config(cls, config: EngineConfig) -> DirectOracle:
        """A fresh pipeline built the way a worker of ``config`` builds its own."""
        device = worker_device(config, 0)
        pipeline = build_pipeline(config.pipeline, device, config.pipeline_kwargs)
        return cls(
            pipeline,
            device,
            step_mode=config.resolved_mode == "step",
            cache_backend=config.cache_backend,
            cache_config=config.cache_config,
        )

    def images(self, prompt: Any, params: SamplingParams, seed: int) -> torch.Tensor | None:
        """The pipeline's images for one request alone, or ``None`` when it fails it."""

        def run(request: PipelineRequest) -> dict[str, Any]:
            if self.step_mode:
                return forward_by_steps(self.pipeline, [request])
            return dict(self.pipeline.forward([request]))

        try:
            produced = self._alone(prompt, params, seed, run)
        except Exception:
            return None
        images = produced.get(ORACLE_ID)
        if not isinstance(images, torch.Tensor):
            return None
        return images.detach().to("cpu")

    def sampled(self, prompt: Any, params: SamplingParams, seed: int) -> SampledOutput | None:
        """The request's output with what it asked for besides images (latents, a
        trajectory), or ``None`` when the pipeline fails it alone. A step pipeline
        runs one step at a time here, and this oracle records the trajectory itself,
        so the runtime's recording cannot hide in both sides; another pipeline's
        ``forward`` answers for itself."""
        run = self._by_hand if callable(getattr(self.pipeline, "post_decode", None)) else None
        try:
            if run is not None:
                return self._alone(prompt, params, seed, run)
            produced = self._alone(
                prompt, params, seed, lambda request: dict(self.pipeline.forward([request]))
            ).get(ORACLE_ID)
        except Exception:
            return None
        return produced if isinstance(produced, SampledOutput) else None

    def _by_hand(self, request: PipelineRequest) -> SampledOutput:
        pipeline = cast(StepPipeline, self.pipeline)
        params = request.params
        state = pipeline.prepare_encode(request)
        latents = [state.latents.clone()]
        log_probs: list[torch.Tensor] = []
        log_prob_steps: list[int] = []
        while not state.is_done:
            step = state.step_index
            [model_output] = pipeline.denoise_step([state])
            pipeline.step_scheduler(state, model_output)
            latents.append(state.latents.clone())
            if params.return_trajectory == "full" and state.step_log_prob is not None:
                log_probs.append(state.step_log_prob.clone())
                log_prob_steps.append(step)
            state.step_log_prob = None
        output = pipeline.post_decode(state) if params.decodes else state.latents
        trajectory = None
        if params.return_trajectory:
            trajectory = TrajectoryTensors(
                torch.stack(latents).cpu(),
                torch.stack(log_probs).cpu() if log_probs else None,
                tuple(int(t) for t in state.timesteps),
                tuple(log_prob_steps),
            )
        return SampledOutput(output.detach().cpu(), trajectory)

    def failure_scope(self, prompt: Any, params: SamplingParams, seed: int) -> FailureScope:
        """Whom the pipeline fails with this request, by the runner's rule: a raising
        ``forward`` (request mode, batched) or ``denoise_step`` (step mode) fails its
        whole batch; a missing or malformed result, or a raising ``prepare_encode``,
        ``step_scheduler`` or ``post_decode``, fails this request alone."""
        outcome = self._alone(prompt, params, seed, self._run_for_scope)
        if isinstance(outcome, FailureScope):
            return outcome
        count = params.num_outputs_per_prompt
        if isinstance(outcome, torch.Tensor) and outcome.ndim == 4 and len(outcome) == count:
            return FailureScope.NONE
        return FailureScope.OWN

    def _run_for_scope(self, request: PipelineRequest) -> FailureScope | object:
        """The request's images, or the scope of the failure that stopped it."""
        if not self.step_mode:
            try:
                produced: dict[str, object] = dict(self.pipeline.forward([request]))
            except Exception:
                batched = self.pipeline.supports_request_batch
                return FailureScope.BATCH if batched else FailureScope.OWN
            return produced.get(ORACLE_ID)
        pipeline = cast(StepPipeline, self.pipeline)
        try:
            state = pipeline.prepare_encode(request)
        except Exception:
            return FailureScope.OWN
        while not state.is_done:
            try:
                [model_output] = pipeline.denoise_step([state])
            except Exception:
                return FailureScope.BATCH
            try:
                pipeline.step_scheduler(state, model_output)
            except Exception:
                return FailureScope.OWN
        try:
            return pipeline.post_decode(state)
        except Exception:
            return FailureScope.OWN

    def _alone(
        self,
        prompt: Any,
        params: SamplingParams,
        seed: int,
        run: Callable[[PipelineRequest], Result],
    ) -> Result:
        """``run`` one request through the pipeline, then have it forget the request."""
        cache = effective_cache(self.cache_backend, self.cache_config, params.cache)
        if cache is not None and cache.rel_l1_thresh == 0.0:
            cache = None  # a threshold of 0 never skips: held to the uncached run
        request = PipelineRequest(ORACLE_ID, prompt, params, seed, self.device, cache)
        try:
            with torch.inference_mode():
                return run(request)
        finally:
            release = getattr(self.pipeline, "release_requests", None)
            if callable(release):  # the engine may share this pipeline object
                release([ORACLE_ID])

    def matches(self, expected: torch.Tensor, actual: torch.Tensor, tolerance: float) -> bool:
        """Whether two image batches are equal (within ``tolerance``, absolute)."""
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            return False
        if tolerance == 0.0:
            return torch.equal(expected, actual)
        return torch.allclose(expected, actual, rtol=0.0, atol=tolerance)
