"""More broken runtimes: scheduling policy, the runner's step loop, aborts,
close and death, the mp executor's replies and bookkeeping, and the front's
consumers. Each is a bug class written the way it would slip in, not the
mirror image of a check; ``docs/auditing.md`` says which check catches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import attrs

from diffusion_runtime.contracts import NewRequestData, RunnerOutput, SchedulerOutput
from diffusion_runtime.core import EngineCore, StepResult
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import DuplicateRequestError, QueueFullError
from diffusion_runtime.executor.mp.calls import CallTable, RpcCall
from diffusion_runtime.executor.mp.executor import MultiprocExecutor
from diffusion_runtime.executor.mp.messages import Reply
from diffusion_runtime.fsm import Trigger
from diffusion_runtime.inbox import QueuedAbort
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepPipeline
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.base import BaseScheduler, Ended
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.scheduler.step_scheduler import StepScheduler
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace

# -- scheduling policy ---------------------------------------------------------------------


def wave_ignores_running_requests() -> Patch:
    def make(original: Any) -> Any:
        def next_wave(self: BaseScheduler) -> list[Request]:
            saved, self.running = self.running, {}  # "capacity is per wave, not per engine"
            try:
                wave: list[Request] = original(self)
            finally:
                self.running = saved
            key = next(iter(self.running.values()), None)
            return [r for r in wave if key is None or r.batch_key == key.batch_key]

        return next_wave

    return _replace(BaseScheduler, "next_wave", make)


def request_waves_mix_step_counts() -> Patch:
    def make(original: Any) -> Any:
        def batch_key_for(self: RequestScheduler, params: SamplingParams) -> Hashable:
            return params.step_batch_key()  # "the pipeline handles mixed step counts anyway"

        return batch_key_for

    return _replace(BaseScheduler, "batch_key_for", make)


def wave_skips_incompatible_requests() -> Patch:
    def make(original: Any) -> Any:
        def next_wave(self: BaseScheduler) -> list[Request]:
            capacity = self.max_num_running_reqs - len(self.running)
            # "skip what does not fit instead of blocking the queue" - but forgets the key
            return list(self.waiting.values())[: max(capacity, 0)]

        return next_wave

    return _replace(BaseScheduler, "next_wave", make)


def duplicate_id_admitted() -> Patch:
    def make(original: Any) -> Any:
        def check_room(self: EngineCore, request_id: str, num_queued: int) -> None:
            if request_id in self.scheduler.waiting:  # "an id is taken while it waits"
                raise DuplicateRequestError(f"request id {request_id!r} is waiting")
            limit = self.config.max_waiting_requests
            if limit is not None and num_queued + self.scheduler.num_waiting >= limit:
                raise QueueFullError(f"waiting queue is full ({limit} requests)")

        return check_room

    return _replace(EngineCore, "_check_room", make)


def running_abort_ignored() -> Patch:
    def make(original: Any) -> Any:
        def abort_request(self: BaseScheduler, request_id: str, reason: str) -> Ended | None:
            if request_id in self.running and self.keeps_runner_state:
                return None  # "a running step-mode request is nearly done: let it finish"
            result: Ended | None = original(self, request_id, reason)
            return result

        return abort_request

    return _replace(BaseScheduler, "abort_request", make)


def completes_one_step_early() -> Patch:
    def make(original: Any) -> Any:
        def update(
            self: StepScheduler, output: SchedulerOutput, result: RunnerOutput
        ) -> list[Ended]:
            for request_id, (step, total) in list(result.progress.items()):
                if step == total - 1 and request_id not in result.errors:
                    # "the last step only decodes": report it done a step early
                    result.progress[request_id] = (total, total)
            ended: list[Ended] = original(self, output, result)
            return ended

        return update

    return _replace(StepScheduler, "update_from_output", make)


# -- the runner's step loop ------------------------------------------------------------------


def first_step_taken_twice() -> Patch:
    def make(original: Any) -> Any:
        def run_step(
            self: ModelRunner, pipeline: StepPipeline, batch: Any, before: list[int], result: Any
        ) -> None:
            for state, step_index in zip(batch, before, strict=True):
                if step_index == 0 and state.num_steps > 2:  # "warm start: two steps at first"
                    [model_output] = pipeline.denoise_step([state])
                    pipeline.step_scheduler(state, model_output)
            original(self, pipeline, batch, before, result)

        return run_step

    return _replace(ModelRunner, "_run_step_by_request", make)


def one_step_short() -> Patch:
    def make(original: Any) -> Any:
        def pipeline_request(self: ModelRunner, data: NewRequestData) -> PipelineRequest:
            request: PipelineRequest = original(self, data)
            steps = data.params.num_inference_steps
            if steps > 1:  # "the last timestep adds nothing visible"
                request.params = attrs.evolve(data.params, num_inference_steps=steps - 1)
            return request

        return pipeline_request

    return _replace(ModelRunner, "_pipeline_request", make)


def seed_dropped_on_the_way() -> Patch:
    def make(original: Any) -> Any:
        def pipeline_request(self: ModelRunner, data: NewRequestData) -> PipelineRequest:
            # "reproducible by default": every request gets the same seed
            return PipelineRequest(data.request_id, data.prompt, data.params, 0, self.device)

        return pipeline_request

    return _replace(ModelRunner, "_pipeline_request", make)


def failed_step_state_kept() -> Patch:
    def make(original: Any) -> Any:
        def release(self: ModelRunner, request_ids: Any) -> list[str]:
            keep = {
                rid for rid in request_ids if rid in self.states and not self.states[rid].is_done
            }
            # "a failed request may be retried: keep its state" (only finished ones go)
            released: list[str] = original(self, [r for r in request_ids if r not in keep])
            return released

        return release

    return _replace(ModelRunner, "_release", make)


# -- outputs, aborts, close and death in the core ----------------------------------------------


def preview_marked_final() -> Patch:
    def make(original: Any) -> Any:
        def progress_outputs(
            self: EngineCore, result: RunnerOutput
        ) -> list[tuple[Request, RequestOutput]]:
            outputs: list[tuple[Request, RequestOutput]] = original(self, result)
            # "the last preview is as good as the final image"
            return [
                (r, attrs.evolve(o, finished=o.num_steps is not None and o.step == o.num_steps - 1))
                for r, o in outputs
            ]

        return progress_outputs

    return _replace(EngineCore, "_progress_outputs", make)


def waiting_abort_output_lost() -> Patch:
    def make(original: Any) -> Any:
        def abort(self: EngineCore, queued: QueuedAbort) -> None:
            waiting = [rid for rid in queued.request_ids if rid in self.scheduler.waiting]
            before = len(self._pending)
            original(self, queued)
            # "a request that never ran has nothing to report"
            self._pending[before:] = [
                item for item in self._pending[before:] if item[1].request_id not in waiting
            ]

        return abort

    return _replace(EngineCore, "_apply_abort", make)


def late_aborts_never_applied() -> Patch:
    def make(original: Any) -> Any:
        def take_wave_inbox(self: EngineCore) -> list[RequestOutput]:
            return []  # "what came during the wave waits for the next step"

        return take_wave_inbox

    return _replace(EngineCore, "_take_wave_inbox", make)


@contextlib.contextmanager
def late_aborts_after_results() -> Iterator[None]:
    taken_late: list[Callable[[EngineCore], list[RequestOutput]]] = []

    def make_take(original: Any) -> Any:
        taken_late.append(original)

        def take_wave_inbox(self: EngineCore) -> list[RequestOutput]:
            return []

        return take_wave_inbox

    def make_commit(original: Any) -> Any:
        def commit(self: EngineCore, output: SchedulerOutput, result: RunnerOutput) -> None:
            original(self, output, result)
            self._refused += taken_late[0](self)  # "once the wave is committed"

        return commit

    with (
        _replace(EngineCore, "_take_wave_inbox", make_take),
        _replace(EngineCore, "_commit", make_commit),
    ):
        yield


def inbox_taken_apart_from_the_pause() -> Patch:
    def make(original: Any) -> Any:
        def step(self: EngineCore) -> StepResult:
            if self.is_paused:  # "admit what came in now; a pause only holds back waves"
                self._take_inbox(self._inbox.take_all())
            result: StepResult = original(self)  # reads the pause again, to schedule or not
            return result

        return step

    return _replace(EngineCore, "_step", make)


def close_skips_waiting_requests() -> Patch:
    def make(original: Any) -> Any:
        def finish_all(self: BaseScheduler, trigger: Trigger, reason: str) -> list[Ended]:
            # "waiting requests never started: nothing to end"
            saved = dict(self.waiting)
            for rid in saved:
                del self.requests[rid]
            self.waiting.clear()
            try:
                ended: list[Ended] = original(self, trigger, reason)
            finally:
                for rid, request in saved.items():
                    self.requests[rid] = request
                    self.waiting[rid] = request
            return ended

        return finish_all

    return _replace(BaseScheduler, "finish_all", make)


def death_spares_waiting_requests() -> Patch:
    def make(original: Any) -> Any:
        def die(self: EngineCore, error: Any) -> None:
            saved = dict(self.scheduler.waiting)  # "only running requests were on the device"
            for rid in saved:
                del self.scheduler.requests[rid]
            self.scheduler.waiting.clear()
            original(self, error)
            self.scheduler.requests.update(saved)
            self.scheduler.waiting.update(saved)

        return die

    return _replace(EngineCore, "_die", make)


# -- the mp executor (engine side) ----------------------------------------------------------


def stale_reply_taken() -> Patch:
    def make(original: Any) -> Any:
        def on_reply(self: CallTable, reply: Reply) -> None:
            if reply.call_id not in self._calls:
                # "a reply with an unknown id belongs to the call waiting now"
                waiting = [c for c in self._calls.values() if isinstance(c, RpcCall)]
                if waiting and reply.error is None:
                    reply = attrs.evolve(reply, call_id=waiting[-1].call_id)
            original(self, reply)

        return on_reply

    return _replace(CallTable, "on_reply", make)


def release_only_output_not_sent() -> Patch:
    def make(original: Any) -> Any:
        def execute(self: MultiprocExecutor, output: SchedulerOutput) -> RunnerOutput:
            if not output.has_work:  # "nothing to run: save the round trip"
                return RunnerOutput(output.wave_id)
            result: RunnerOutput = original(self, output)
            return result

        return execute

    return _replace(MultiprocExecutor, "execute", make)


# -- the front's consumers --------------------------------------------------------------------


def dropped_consumer_not_aborted() -> Patch:
    def make(original: Any) -> Any:
        def abort_for(self: DiffusionEngine, request_ids: Any, sink: Any, reason: str) -> None:
            if reason == "the consumer stopped reading":
                return  # "the result is cheap to finish; drop it at delivery"
            original(self, request_ids, sink, reason)

        return abort_for

    return _replace(DiffusionEngine, "_abort_for", make)


#: Scheduling policy, the runner's step loop, the core's outputs, the mp executor and the front.
POLICY_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="wave-over-capacity", mode="step", target="core",
             bug="a wave ignores the requests already running",
             patch=wave_ignores_running_requests),
    Mutation(name="request-waves-mix-steps", mode="request", target="core",
             bug="request-mode waves batch different step counts",
             patch=request_waves_mix_step_counts),
    Mutation(name="wave-ignores-key", mode="step", target="core",
             bug="a wave takes incompatible requests", patch=wave_skips_incompatible_requests),
    Mutation(name="duplicate-id-admitted", mode="step", target="core",
             bug="the core queues an id a running request uses", patch=duplicate_id_admitted),
    Mutation(name="running-abort-ignored", mode="step", target="core",
             bug="a running step-mode request ignores its abort", patch=running_abort_ignored),
    Mutation(name="completes-a-step-early", mode="step", target="core",
             bug="a request completes one step early", patch=completes_one_step_early),
    Mutation(name="first-step-twice", mode="step", target="core",
             bug="the runner takes a new request's first step twice", patch=first_step_taken_twice),
    Mutation(name="one-step-short", mode="request", target="core",
             bug="the runner runs one denoising step fewer than asked", patch=one_step_short),
    Mutation(name="seed-dropped", mode="request", target="core",
             bug="the runner hands every request the same seed", patch=seed_dropped_on_the_way),
    Mutation(name="failed-step-state-kept", mode="step", target="core",
             bug="runner state of a failed step-mode request is kept",
             patch=failed_step_state_kept),
    Mutation(name="preview-marked-final", mode="step", target="core",
             bug="the last preview goes out as a final output", patch=preview_marked_final),
    Mutation(name="waiting-abort-output-lost", mode="request", target="core",
             bug="an aborted waiting request gets no final output",
             patch=waiting_abort_output_lost),
    Mutation(name="late-aborts-never-applied", mode="request", target="core",
             bug="aborts during a wave are not applied", patch=late_aborts_never_applied),
    Mutation(name="late-aborts-after-results", mode="request", target="core",
             bug="aborts during a wave lose to its results", patch=late_aborts_after_results),
    Mutation(name="inbox-apart-from-pause", mode="request", target="lockstep",
             bug="a paused step admits what is queued, then reads the pause to decide whether to "
                 "schedule", patch=inbox_taken_apart_from_the_pause),
    Mutation(name="close-skips-waiting", mode="request", target="core",
             bug="close leaves waiting requests open", patch=close_skips_waiting_requests),
    Mutation(name="death-spares-waiting", mode="request", target="core",
             bug="death leaves waiting requests open", patch=death_spares_waiting_requests),
    Mutation(name="mp-stale-reply-taken", mode="step", target="mp",
             bug="an mp reply to a timed-out RPC answers the next call", patch=stale_reply_taken),
    Mutation(name="mp-release-not-sent", mode="step", target="mp",
             bug="mp skips outputs that only release finished ids",
             patch=release_only_output_not_sent),
    Mutation(name="dropped-consumer-not-aborted", mode="step", target="front",
             bug="a consumer that stops reading does not abort",
             patch=dropped_consumer_not_aborted),
)  # fmt: skip
