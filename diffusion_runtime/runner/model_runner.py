"""ModelRunner: calls the pipeline for a scheduler output and maps results by id."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import attrs
import torch

from diffusion_runtime.cache_settings import CacheSettings, effective_cache
from diffusion_runtime.contracts import (
    READY,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    WaveCosts,
)
from diffusion_runtime.errors import (
    DeviceFault,
    InvalidFieldError,
    PipelineContractError,
    describe_error,
)
from diffusion_runtime.pipelines.phases import timing_forward
from diffusion_runtime.pipelines.protocols import (
    STEP_METHODS,
    PipelineRequest,
    RequestPipeline,
    StepPipeline,
    StepRequestState,
    decode_finished,
)
from diffusion_runtime.pipelines.step_tally import tallying_steps
from diffusion_runtime.runner.faults import is_sticky_device_fault
from diffusion_runtime.runner.host_copy import HostCopier
from diffusion_runtime.runner.input_batch import InputBatch
from diffusion_runtime.runner.memory_peak import PeakMemoryMeter
from diffusion_runtime.runner.state_offload import StateOffloader
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.trajectory import SampledOutput, TrajectoryTensors

_Result = TypeVar("_Result")


class ModelRunner:
    """Runs scheduler outputs on one device, in request mode or step mode.

    Every request gets its own ``torch.Generator`` seeded from its seed, and
    every result is matched to its request by id, never by position. A
    pipeline error fails only the requests it concerns; a sticky device fault
    is raised as :class:`DeviceFault` for the executor.

    In step mode the runner owns each running request's
    :class:`StepRequestState`: created by ``prepare_encode`` when the request
    first appears, advanced one step per output, dropped as soon as the
    request finishes or fails here, or when an output lists it as finished.
    With ``preview_interval`` k > 0, a pipeline's optional ``preview`` runs
    every k steps for streaming; a request that streams its trajectory gets
    the part recorded since its previous result with every step but its last
    (whose result carries the whole). With ``offload_budget_bytes`` > 0, the
    states of requests a step does not run (preempted ones) are kept in host
    memory within that budget and brought back before they run (see
    :class:`StateOffloader`).

    Results come back in two phases (see :class:`HostCopier`): the returned
    output's ``output_ready`` fence says when its images and previews have
    reached host memory. With ``overlap_outputs`` off, or on the CPU, they are
    there when :meth:`execute_model` returns.

    Each output says what its wave cost (:class:`WaveCosts`): the seconds of
    each request's encode, denoise and decode phases, and the worker's memory
    high-water mark (:class:`PeakMemoryMeter`), and each request's steps:
    model evaluations and cached steps.

    ``cache_backend`` and ``cache_config`` are the engine's step cache; each
    request runs with them overridden by its ``SamplingParams.cache``
    (``docs/caching.md``). The pipeline names the backends it serves in its
    optional ``cache_backends`` member.
    """

    def __init__(
        self,
        pipeline: RequestPipeline,
        device: torch.device,
        *,
        step_mode: bool = False,
        preview_interval: int = 0,
        overlap_outputs: bool = True,
        offload_budget_bytes: int = 0,
        cache_backend: str | None = None,
        cache_config: Mapping[str, Any] | None = None,
    ) -> None:
        needed = ("forward", *STEP_METHODS) if step_mode else ("forward",)
        missing = [m for m in needed if not callable(getattr(pipeline, m, None))]
        if not hasattr(pipeline, "supports_request_batch"):
            missing.append("supports_request_batch")
        if missing:
            mode = "step" if step_mode else "request"
            raise PipelineContractError(
                f"{mode} mode needs a pipeline with {', '.join(needed)} and "
                f"supports_request_batch; {type(pipeline).__name__} lacks {', '.join(missing)}"
            )
        self.pipeline = pipeline
        self.device = device
        self.cache_backend = cache_backend
        self.cache_config = dict(cache_config or {})
        if cache_backend is not None:
            self._check_cache_backend("EngineConfig", "cache_backend", cache_backend, cache_backend)
        self.step_mode = step_mode
        self.preview_interval = preview_interval
        self._preview = getattr(pipeline, "preview", None) if preview_interval else None
        self._release_in_pipeline = getattr(pipeline, "release_requests", None)
        self._step_batch = getattr(pipeline, "step_batch", None) if step_mode else None
        self._post_decode_batch = (
            getattr(pipeline, "post_decode_batch", None) if step_mode else None
        )
        self.states: dict[str, StepRequestState] = {}
        self.input_batch = InputBatch()
        self.host_copier = HostCopier(device, overlap=overlap_outputs)
        self.memory = PeakMemoryMeter(device)
        self.offloader = (
            StateOffloader(device, offload_budget_bytes)
            if step_mode and offload_budget_bytes
            else None
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one output; return once its work is enqueued (compute done)."""
        started = time.perf_counter()
        costs = WaveCosts()
        self.memory.begin()
        result = RunnerOutput(scheduler_output.wave_id, costs=costs)
        result.released.extend(self._release(scheduler_output.finished_ids))
        with torch.inference_mode():
            if self.step_mode:
                self._step(scheduler_output, result)
            else:
                self._forward_wave(scheduler_output, result)
        fence = self.host_copier.fence()
        costs.peak_memory_bytes = self.memory.peak_bytes()
        costs.seconds = time.perf_counter() - started
        return result if fence is READY else attrs.evolve(result, output_ready=fence)

    def close(self) -> None:
        """Close what the runner holds open (the memory meter's files)."""
        self.memory.close()

    def check_output_options(self, params: SamplingParams) -> None:
        """Refuse, by field, latents or a trajectory that this runner cannot return:
        step mode records them for any pipeline; request mode needs a pipeline
        whose ``forward`` honours them (``supports_output_options``)."""
        if self.step_mode or getattr(self.pipeline, "supports_output_options", False):
            return
        name = type(self.pipeline).__name__
        rule = f"needs step mode, or a pipeline that returns it in request mode ({name} does not)"
        if not params.decodes:
            raise InvalidFieldError("SamplingParams", "output_type", rule, params.output_type)
        if params.return_trajectory:
            raise InvalidFieldError(
                "SamplingParams", "return_trajectory", rule, params.return_trajectory
            )

    def check_custom_schedule(self, params: SamplingParams) -> None:
        """Refuse, by field, ``timesteps`` or ``sigmas`` that the pipeline does not take:
        it names what it honours in its optional ``custom_schedules`` member."""
        schedule = params.custom_schedule
        if schedule is None:
            return
        field, values = schedule
        if field not in getattr(self.pipeline, "custom_schedules", ()):
            name = type(self.pipeline).__name__
            rule = f"needs a pipeline that takes custom {field} ({name} does not)"
            raise InvalidFieldError("SamplingParams", field, rule, values)

    def check_step_cache(self, params: SamplingParams) -> None:
        """Refuse, on ``SamplingParams.cache``, an override that names no backend
        (and the engine has none) or one the pipeline does not serve."""
        if not isinstance(params.cache, dict):
            return
        settings = self.cache_settings(params)
        if settings is None:
            rule = "names no backend, and EngineConfig.cache_backend is None"
            raise InvalidFieldError("SamplingParams", "cache", rule, params.cache)
        self._check_cache_backend("SamplingParams", "cache", settings.backend, params.cache)

    def cache_settings(self, params: SamplingParams) -> CacheSettings | None:
        """The step cache a request with ``params`` runs with (``None``: none)."""
        return effective_cache(self.cache_backend, self.cache_config, params.cache)

    def _check_cache_backend(self, owner: str, field: str, backend: str, value: object) -> None:
        served: frozenset[str] = getattr(self.pipeline, "cache_backends", frozenset())
        if backend not in served:
            name = type(self.pipeline).__name__
            names = ", ".join(sorted(served)) or "none"
            rule = f"needs a pipeline that serves the {backend!r} cache ({name} serves {names})"
            raise InvalidFieldError(owner, field, rule, value)

    def release_requests(self, request_ids: Sequence[str]) -> None:
        """Drop the step state of finished requests (no-op for ids not held)."""
        self._release(request_ids)

    def _release(self, request_ids: Sequence[str]) -> list[str]:
        states = self.states
        released = [rid for rid in request_ids if states.pop(rid, None) is not None]
        if self.offloader is not None:
            self.offloader.forget(request_ids)
        if released:
            self.input_batch.invalidate()
            if self._release_in_pipeline is not None:
                self._release_in_pipeline(released)
        return released

    def cached_request_ids(self) -> list[str]:
        """Ids of requests with state held between outputs."""
        return list(self.states)

    def offloaded_request_ids(self) -> list[str]:
        """Ids of the cached requests whose state is now in host memory."""
        return [] if self.offloader is None else self.offloader.offloaded_ids()

    # -- request mode ------------------------------------------------------------------

    def _forward_wave(self, scheduler_output: SchedulerOutput, result: RunnerOutput) -> None:
        batch = [self._pipeline_request(data) for data in scheduler_output.scheduled_new_reqs]
        if not batch:
            return
        result.executed.extend(request.request_id for request in batch)
        if self.pipeline.supports_request_batch:
            self._forward(batch, result)
        else:
            for request in batch:
                self._forward([request], result)
        if self._release_in_pipeline is not None:
            self._release_in_pipeline([request.request_id for request in batch])

    def _forward(self, batch: list[PipelineRequest], result: RunnerOutput) -> None:
        try:
            with timing_forward() as clock, tallying_steps() as steps:
                produced = self.pipeline.forward(batch)
        except Exception as exc:
            _reraise_if_sticky(exc)
            _fail_all(result, [r.request_id for r in batch], exc)
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
        costs = _costs(result)
        for phase, seconds in clock.seconds.items():
            costs.charge(expected, phase, seconds)
        for request in batch:
            # A forward that tallies nothing ran the model at every step.
            ran, reused = steps.get(request.request_id, (request.params.num_inference_steps, 0))
            costs.count_steps(request.request_id, ran, reused)
        for request in batch:
            self._accept_images(request, produced.get(request.request_id), result)

    # -- step mode ---------------------------------------------------------------------

    def _step(self, scheduler_output: SchedulerOutput, result: RunnerOutput) -> None:
        pipeline = cast(StepPipeline, self.pipeline)
        # Idle states leave the device before new ones are encoded. An output
        # that only releases states is no step: it leaves every state in place.
        offloader = self.offloader
        if (
            offloader is not None
            and scheduler_output.has_work
            and offloader.place(self.states, scheduler_output.scheduled_ids)
        ):
            self.input_batch.invalidate()
        costs = _costs(result)
        for data in scheduler_output.scheduled_new_reqs:
            try:
                with _timed(costs, (data.request_id,), "encode"):
                    state = pipeline.prepare_encode(self._pipeline_request(data))
                state.begin_trajectory()
                self.states[data.request_id] = state
                result.created.append(data.request_id)
                self.input_batch.invalidate()
            except Exception as exc:
                _reraise_if_sticky(exc)
                result.errors[data.request_id] = describe_error(exc)
        ids = []
        for request_id in scheduler_output.scheduled_ids:
            if request_id in self.states:
                ids.append(request_id)
            elif request_id not in result.errors:
                result.errors[request_id] = "the runner holds no step state for this request"
        if not ids:
            return
        batch = self.input_batch
        batch.update(tuple(ids), self.states)
        result.executed.extend(ids)
        before = [state.step_index for state in batch]
        if self._step_batch is not None:
            self._run_step_batch(self._step_batch, pipeline, batch, before, result)
        else:
            self._run_step_by_request(pipeline, batch, before, result)
        # Finished or failed here: free the tensors now.
        done = [rid for rid in ids if rid in result.errors or rid in result.images]
        result.released.extend(self._release(done))

    def _run_step_batch(
        self,
        step_batch: Callable[[InputBatch], None],
        pipeline: StepPipeline,
        batch: InputBatch,
        before: list[int],
        result: RunnerOutput,
    ) -> None:
        try:
            with _timed(_costs(result), batch.request_ids, "denoise"):
                step_batch(batch)
        except Exception as exc:
            _reraise_if_sticky(exc)
            _fail_all(result, batch.request_ids, exc)
            return
        finished: list[StepRequestState] = []
        for state, step_index in zip(batch, before, strict=True):
            self._report(state, step_index, result, finished)
        self._decode(pipeline, finished, result)

    def _run_step_by_request(
        self, pipeline: StepPipeline, batch: InputBatch, before: list[int], result: RunnerOutput
    ) -> None:
        costs = _costs(result)
        with _timed(costs, batch.request_ids, "denoise"):
            model_outputs = _one_result_each(
                pipeline.denoise_step, batch, result, ("denoise_step", "outputs")
            )
        if model_outputs is None:
            return
        finished: list[StepRequestState] = []
        for state, model_output, step_index in zip(batch, model_outputs, before, strict=True):
            try:
                with _timed(costs, (state.request_id,), "denoise"):
                    pipeline.step_scheduler(state, model_output)
            except Exception as exc:
                _reraise_if_sticky(exc)
                result.errors[state.request_id] = describe_error(exc)
                continue
            self._report(state, step_index, result, finished)
        self._decode(pipeline, finished, result)

    def _report(
        self,
        state: StepRequestState,
        before: int,
        result: RunnerOutput,
        finished: list[StepRequestState],
    ) -> None:
        """Record a stepped request's progress; queue it for decoding, or preview it.
        A step that left its index ``before`` in place, or moved it past the last
        step, failed the request (the pipeline's way to fail one state of a
        ``step_batch``); it is released with this step, as any failed here is."""
        request_id = state.request_id
        if not before < state.step_index <= state.num_steps:
            result.errors[request_id] = (
                f"the pipeline's step moved the step index from {before} to "
                f"{state.step_index} (of {state.num_steps})"
            )
            return
        taken = state.step_index - before
        cached = taken if state.step_cached else 0
        _costs(result).count_steps(request_id, taken - cached, cached)
        state.record_step()
        result.progress[request_id] = (state.step_index, state.num_steps)
        if state.is_done:
            finished.append(state)
            return
        if self._preview is not None and state.step_index % self.preview_interval == 0:
            try:
                preview = self._preview(state)
                if preview is not None:
                    result.previews[request_id] = self.host_copier.to_host(preview)
            except Exception as exc:
                _reraise_if_sticky(exc)
                result.errors[request_id] = describe_error(exc)
                result.progress.pop(request_id, None)
                return
        part = state.trajectory_part()
        if part is not None:
            self._put_trajectory(request_id, part, result)

    def _decode(
        self, pipeline: StepPipeline, states: list[StepRequestState], result: RunnerOutput
    ) -> None:
        """Decode finished requests (together when the pipeline has
        ``post_decode_batch``; one by one when it has not, so one's error fails only it)."""
        costs = _costs(result)
        if self._post_decode_batch is not None and len(states) > 1:
            try:
                with _timed(costs, [state.request_id for state in states], "decode"):
                    decoded = decode_finished(pipeline, states)
            except Exception as exc:
                _reraise_if_sticky(exc)
                _fail_all(result, [state.request_id for state in states], exc)
                return
            for state, images in zip(states, decoded, strict=True):
                self._accept_images(state.request, state.result(images), result)
            return
        for state in states:
            try:
                with _timed(costs, (state.request_id,), "decode"):
                    [images] = decode_finished(pipeline, [state])
                self._accept_images(state.request, state.result(images), result)
            except Exception as exc:
                _reraise_if_sticky(exc)
                _fail_all(result, [state.request_id], exc)

    # -- shared ------------------------------------------------------------------------

    def _pipeline_request(self, data: NewRequestData) -> PipelineRequest:
        cache = self.cache_settings(data.params)
        return PipelineRequest(
            data.request_id, data.prompt, data.params, data.seed, self.device, cache
        )

    def _accept_images(
        self, request: PipelineRequest, produced: object, result: RunnerOutput
    ) -> None:
        """Take a request's result (images, or a :class:`SampledOutput`) to host memory."""
        sampled = produced if isinstance(produced, SampledOutput) else None
        output = produced if sampled is None else sampled.output
        problem = _check_output(output, request) or _check_sampled(sampled, request)
        if problem is not None:
            result.errors[request.request_id] = problem
            return
        assert isinstance(output, torch.Tensor)
        request_id = request.request_id
        result.images[request_id] = self.host_copier.to_host(output)
        trajectory = None if sampled is None else sampled.trajectory
        if trajectory is not None:
            self._put_trajectory(request_id, trajectory, result)

    def _put_trajectory(
        self, request_id: str, trajectory: TrajectoryTensors, result: RunnerOutput
    ) -> None:
        """Take a whole trajectory, or a streamed part of one, to host memory."""
        result.trajectory_latents[request_id] = self.host_copier.to_host(trajectory.latents)
        if trajectory.log_probs is not None:
            log_probs = self.host_copier.to_host(trajectory.log_probs)
            result.trajectory_log_probs[request_id] = log_probs
        result.trajectory_steps[request_id] = (trajectory.timesteps, trajectory.log_prob_steps)


def _costs(result: RunnerOutput) -> WaveCosts:
    costs = result.costs
    assert costs is not None  # execute_model made it
    return costs


@contextmanager
def _timed(costs: WaveCosts, request_ids: Sequence[str], phase: str) -> Iterator[None]:
    """Charge the enclosed call's duration (raised or not) to ``request_ids``' ``phase``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        costs.charge(request_ids, phase, time.perf_counter() - start)


def _reraise_if_sticky(exc: Exception) -> None:
    if is_sticky_device_fault(exc):
        raise exc if isinstance(exc, DeviceFault) else DeviceFault(str(exc)) from exc


def _fail_all(result: RunnerOutput, request_ids: Sequence[str], exc: Exception) -> None:
    message = describe_error(exc)
    for request_id in request_ids:
        result.errors[request_id] = message
        result.progress.pop(request_id, None)


def _one_result_each(
    call: Callable[[Sequence[StepRequestState]], Sequence[_Result]],
    states: Sequence[StepRequestState],
    result: RunnerOutput,
    what: tuple[str, str],
) -> Sequence[_Result] | None:
    """``call(states)``: one pipeline call that returns one result per state, in
    order; or None when it failed every state: it raised (a sticky device fault
    is raised on) or returned another number. ``what``: the call's name and its
    results' (for that error)."""
    try:
        produced = call(states)
        if len(produced) != len(states):
            name, results = what
            raise RuntimeError(
                f"{name} returned {len(produced)} {results} for {len(states)} states"
            )
    except Exception as exc:
        _reraise_if_sticky(exc)
        _fail_all(result, [state.request_id for state in states], exc)
        return None
    return produced


def _check_output(output: object, request: PipelineRequest) -> str | None:
    """Why a request's images (or latents) are unusable, or None."""
    if output is None:
        return "pipeline returned no output for this request"
    decodes = request.params.decodes
    if not isinstance(output, torch.Tensor) or (decodes and output.dim() != 4):
        shape = "(N, C, H, W) tensor" if decodes else "tensor of latents, first dimension N"
        return f"pipeline output must be a {shape}; got {type(output).__name__}"
    expected = request.params.num_outputs_per_prompt
    if output.dim() == 0 or output.shape[0] != expected:
        count = 0 if output.dim() == 0 else output.shape[0]
        return f"pipeline returned {count} images; num_outputs_per_prompt is {expected}"
    return None


def _check_sampled(sampled: SampledOutput | None, request: PipelineRequest) -> str | None:
    """Why a pipeline's answer lacks what the request asked for besides images, or None."""
    params = request.params
    if not params.decodes and sampled is None:
        return "the request asked for latents (output_type='latent'); the pipeline returned images"
    if params.return_trajectory and (sampled is None or sampled.trajectory is None):
        return "the request asked for a trajectory; the pipeline returned none"
    return None
