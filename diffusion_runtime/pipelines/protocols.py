"""What a pipeline must provide to run inside the runtime.

A pipeline is model code only: it never sees queues, the scheduler or the
engine. It receives :class:`PipelineRequest` objects (identity, prompt,
parameters, a private random generator) and returns images keyed by request id.

Images are float tensors of shape ``(num_outputs_per_prompt, C, H, W)`` with
values in ``[0, 1]``, on any device; the runner moves them to the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from diffusion_runtime.cache_settings import CacheSettings
from diffusion_runtime.pipelines.phases import timed_phase
from diffusion_runtime.pipelines.step_tally import tally_step
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.trajectory import SampledOutput, TrajectoryRecorder, TrajectoryTensors

Prompt = Any


class PipelineRequest:
    """One request as a pipeline sees it.

    ``generator`` is created on first use, on the runner's device, seeded with
    ``seed``: every random draw a pipeline makes for this request must come
    from it, so the output depends only on this request, never on batch mates.
    ``cache`` is the step cache the request runs with (the engine's settings
    overridden by ``params.cache``; ``None``: none), resolved by the runner.
    """

    __slots__ = ("_generator", "cache", "device", "params", "prompt", "request_id", "seed")

    def __init__(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        seed: int,
        device: torch.device,
        cache: CacheSettings | None = None,
    ) -> None:
        self.request_id = request_id
        self.cache = cache
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.device = device
        self._generator: torch.Generator | None = None

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=self.device).manual_seed(self.seed)
        return self._generator


@runtime_checkable
class RequestPipeline(Protocol):
    """The request-mode contract: one full forward for a batch of requests.

    ``forward`` returns one image tensor per request, keyed by request id. When
    ``supports_request_batch`` is False the runner calls it with one request at
    a time. Optional members, looked up by name:

    - ``validate_request(prompt, params) -> None``: raise ``ValueError`` (ideally
      :class:`~diffusion_runtime.errors.InvalidFieldError`) for input this
      pipeline cannot serve; called at admission, so a bad request costs nothing.
      It runs on the caller's thread, possibly while a wave executes: keep it
      cheap and free of shared mutable state.
    - ``warmup_request() -> (prompt, SamplingParams)``: a cheap request for start-up.
    - ``close() -> None``: release what the pipeline holds.
    - ``held_request_ids() -> Iterable[str]``: ids of requests the pipeline
      keeps state for; the harness checks it holds none for a finished request.
    - ``release_requests(request_ids) -> None``: the runner is done with these
      requests (after their forward in request mode; in step mode when it
      drops their step state: finished, failed or aborted).
    - ``seed_free = True``: the outputs do not depend on the seed (the harness
      then skips its seed check).
    - ``supports_output_options = True``: ``forward`` honours
      ``SamplingParams.output_type`` and ``return_trajectory``, returning a
      :class:`~diffusion_runtime.trajectory.SampledOutput` for a request that
      uses them (:func:`forward_by_steps` does). Without it, request mode
      refuses such requests at admission; step mode serves them for any
      step pipeline.
    - ``custom_schedules``: the names among ``"timesteps"`` and ``"sigmas"``
      whose :class:`SamplingParams` field this pipeline honours, in both modes
      (its own checks of the values go in ``validate_request``). A request
      that brings another is refused at admission.
    - ``parallel_degrees``: the :class:`~diffusion_runtime.config.EngineConfig`
      degree fields (``"cfg_parallel_size"``, ...) this pipeline splits its
      forward by; a degree above 1 that it does not declare is refused at
      start-up. With one above 1, the worker calls ``enable_parallel(context)``
      once, with this rank's
      :class:`~diffusion_runtime.pipelines.parallel.ParallelContext`
      (``docs/parallelism.md``).
    """

    supports_request_batch: bool

    def forward(
        self, batch: Sequence[PipelineRequest]
    ) -> Mapping[str, torch.Tensor | SampledOutput]: ...


@attrs.define(eq=False)
class StepRequestState:
    """A request's denoising state in step mode, owned by the runner.

    The pipeline creates it in ``prepare_encode`` and advances it in
    ``step_scheduler``. ``scheduler`` is the request's own noise-scheduler
    object (schedulers are stateful and never shared); ``conditioning`` holds
    whatever the pipeline encoded once for this request. A step that draws
    noise sets ``step_log_prob`` to the log-density of what it drew (one value
    per image) for trajectories with log-probabilities; ``recorder`` is the
    runtime's, set when the request asked for a trajectory.
    ``step_cache`` is the request's own step cache, made by the pipeline from
    ``request.cache`` (e.g. a :class:`~diffusion_runtime.pipelines.step_cache.TeaCacheState`);
    a step that reused an earlier model output instead of running the model
    sets ``step_cached`` (the runner counts it; :meth:`record_step` resets it).
    """

    request: PipelineRequest
    latents: torch.Tensor
    timesteps: Sequence[int]
    step_index: int = 0
    scheduler: Any = None
    conditioning: Any = None
    step_log_prob: torch.Tensor | None = None
    recorder: TrajectoryRecorder | None = None
    step_cache: Any = None
    step_cached: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def is_done(self) -> bool:
        return self.step_index >= len(self.timesteps)

    def begin_trajectory(self) -> None:
        """Start recording, if the request asked for a trajectory (after ``prepare_encode``)."""
        kind = self.request.params.return_trajectory
        if kind:
            self.recorder = TrajectoryRecorder(with_log_probs=kind == "full")
            self.recorder.record(self.latents, -1, None)

    def record_step(self) -> None:
        """Record the step just taken (its latents and log-prob) when recording."""
        if self.recorder is not None:
            self.recorder.record(self.latents, self.step_index - 1, self.step_log_prob)
        self.step_log_prob = None
        self.step_cached = False

    def trajectory_part(self) -> TrajectoryTensors | None:
        """The trajectory recorded since the previous part, for a request that
        streams it (``SamplingParams.stream_trajectory``); else ``None``."""
        if self.recorder is None or not self.request.params.stream_trajectory:
            return None
        return self.recorder.take_part(self._timestep_ints())

    def _timestep_ints(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self.timesteps)

    def result(self, images: torch.Tensor | None) -> torch.Tensor | SampledOutput:
        """What the finished request returns: its ``images`` (``None`` when it
        asked for latents), or a :class:`SampledOutput` when it asked for more."""
        output = self.latents if images is None else images
        if self.recorder is None and images is not None:
            return output
        trajectory = None
        if self.recorder is not None:
            trajectory = self.recorder.finish(self._timestep_ints())
        return SampledOutput(output, trajectory)


#: The methods step mode needs, checked when the engine starts.
STEP_METHODS = ("prepare_encode", "denoise_step", "step_scheduler", "post_decode")


@runtime_checkable
class StepPipeline(RequestPipeline, Protocol):
    """The step-mode contract: the denoising loop split at step boundaries.

    - ``prepare_encode(request)`` runs once per request: encode conditioning,
      draw initial latents from ``request.generator``, set up timesteps.
    - ``denoise_step(states)`` runs the model once over the stacked batch and
      returns one model output per state, in the order given. The states may
      be at different step indices. ``states`` is an
      :class:`~diffusion_runtime.runner.input_batch.InputBatch`: its ``cache``
      dict keeps what the pipeline stacks once while the batch is unchanged.
    - ``step_scheduler(state, model_output)`` advances one request by one step
      (updates ``state.latents``, increments ``state.step_index``).
    - ``post_decode(state)`` turns a finished state into images.

    Optional:

    - ``preview(state) -> Tensor | None``, an intermediate image for
      streaming (e.g. the current prediction of the clean image).
    - ``step_batch(states) -> None``: one whole step for every state, equal
      for each request to ``denoise_step`` then ``step_scheduler``, but free to
      run requests at the same step through one scheduler step on stacked
      latents. When present, the runner (and :func:`forward_by_steps`) calls it
      instead of those two; an error in it fails every request of the step,
      and a state whose ``step_index`` it leaves in place fails alone.
    - ``post_decode_batch(states) -> Sequence[Tensor]``: ``post_decode`` of
      several requests that finished at the same step, in one go (one result
      per state, in order); an error in it fails all of them.
    """

    def prepare_encode(self, request: PipelineRequest) -> StepRequestState: ...

    def denoise_step(self, states: Sequence[StepRequestState]) -> Sequence[torch.Tensor]: ...

    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None: ...

    def post_decode(self, state: StepRequestState) -> torch.Tensor: ...


def forward_by_steps(
    pipeline: StepPipeline, batch: Sequence[PipelineRequest]
) -> dict[str, torch.Tensor | SampledOutput]:
    """A request-mode ``forward`` made of the step-mode methods.

    Runs every request of ``batch`` to its last step (requests with fewer
    steps leave the batch early) and decodes it, together with those that
    finish at the same step, as the runner does. A pipeline whose ``forward``
    is this function gives bit-identical images in both execution modes. A
    ``step_batch`` that leaves a request's step index where it was (which
    fails that request in step mode) raises, failing the forward. It marks
    its encoding and decoding for the request's stage durations
    (:func:`~diffusion_runtime.pipelines.phases.timed_phase`).
    """
    with timed_phase("encode"):
        states = [pipeline.prepare_encode(request) for request in batch]
    for state in states:
        state.begin_trajectory()
    step_batch = getattr(pipeline, "step_batch", None)
    results: dict[str, torch.Tensor | SampledOutput] = {}
    active = states
    while active:
        if step_batch is not None:
            before = [state.step_index for state in active]
            step_batch(active)
            for state, index in zip(active, before, strict=True):
                if state.step_index <= index:  # the runner fails such a request
                    raise RuntimeError(f"step_batch did not advance {state.request_id!r}")
        else:
            for state, model_output in zip(active, pipeline.denoise_step(active), strict=True):
                pipeline.step_scheduler(state, model_output)
        for state in active:
            tally_step(state.request_id, cached=state.step_cached)
            state.record_step()
        done = [state for state in active if state.is_done]
        with timed_phase("decode"):
            decoded = decode_finished(pipeline, done)
        for state, images in zip(done, decoded, strict=True):
            results[state.request_id] = state.result(images)
        active = [state for state in active if not state.is_done]
    return {state.request_id: results[state.request_id] for state in states}


def decode_finished(
    pipeline: StepPipeline, states: Sequence[StepRequestState]
) -> list[torch.Tensor | None]:
    """The images of requests that finished together, in order (``None`` for one
    that asked for latents): in one ``post_decode_batch`` call when the pipeline
    has it and more than one needs decoding."""
    decode = [state for state in states if state.request.params.decodes]
    decode_batch = getattr(pipeline, "post_decode_batch", None)
    if decode_batch is not None and len(decode) > 1:
        decoded = list(decode_batch(decode))
        if len(decoded) != len(decode):
            raise RuntimeError(
                f"post_decode_batch returned {len(decoded)} results for {len(decode)} states"
            )
    else:
        decoded = [pipeline.post_decode(state) for state in decode]
    images = dict(zip([id(state) for state in decode], decoded, strict=True))
    return [images.get(id(state)) for state in states]
