"""Broken preemption: bugs in how a preempted request keeps its place, its state
and its cleanup. Each is written the way it would slip in; the core harness
under a preemptive policy (:mod:`.core_harness`) must catch each, and ``docs/auditing.md``
says which check does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, cast

from diffusion_runtime.contracts import SchedulerOutput
from diffusion_runtime.fsm import LifecycleEvent, RequestStatus, Trigger
from diffusion_runtime.pipelines.protocols import StepPipeline, StepRequestState
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.runner.state_offload import StateOffloader
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.step_scheduler import StepScheduler
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace


def resume_resends_the_payload() -> Patch:
    def make(original: Any) -> Any:
        def schedule(self: StepScheduler, now: float) -> SchedulerOutput | None:
            preempt, admit = self.plan(now, may_preempt=True)
            for request in preempt:
                self.machine.fire(request, Trigger.PREEMPT)
            # "the workers may have evicted it meanwhile: send a resumed request in full"
            return self.build_output(admit, tuple(self.running))

        return schedule

    return _replace(StepScheduler, "schedule", make)


def preemption_frees_runner_state() -> Patch:
    def make(original: Any) -> Any:
        def on_preempted(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            original(self, request, event)
            # "free its latents while it waits; it keeps its step index to resume from"
            self._finished_ids.append(request.request_id)

        return on_preempted

    return _replace(BaseScheduler, "_on_preempted", make)


def offloaded_latents_rebuilt_from_noise() -> Patch:
    sat_out: weakref.WeakKeyDictionary[ModelRunner, set[str]] = weakref.WeakKeyDictionary()

    def make(original: Any) -> Any:
        def step(self: ModelRunner, output: SchedulerOutput, result: Any) -> None:
            pipeline = cast(StepPipeline, self.pipeline)
            for request_id in sat_out.pop(self, set()) & set(output.scheduled_cached_ids):
                state = self.states[request_id]
                # "its latents were offloaded while it sat out; rebuild them" - from noise,
                # while the state keeps the step it had reached
                state.latents = pipeline.prepare_encode(state.request).latents
            original(self, output, result)
            if output.scheduled_ids:
                sat_out[self] = set(self.states) - set(output.scheduled_ids)

        return step

    return _replace(ModelRunner, "_step", make)


def preempted_runs_in_the_wave() -> Patch:
    def make(original: Any) -> Any:
        def schedule(self: StepScheduler, now: float) -> SchedulerOutput | None:
            preempt, admit = self.plan(now, may_preempt=True)
            cached_ids = tuple(self.running)  # taken once, before the preemptions below
            for request in preempt:
                self.machine.fire(request, Trigger.PREEMPT)
            resumed = tuple(r for r in admit if r.state is RequestStatus.PREEMPTED)
            new = [r for r in admit if r.state is not RequestStatus.PREEMPTED]
            return self.build_output(new, (*cached_ids, *(r.request_id for r in resumed)), resumed)

        return schedule

    return _replace(StepScheduler, "schedule", make)


def preempted_end_not_released() -> Patch:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            request_id = request.request_id
            del self.requests[request_id]
            if event.source is RequestStatus.RUNNING:
                del self.running[request_id]
                # "only a running request has state on the workers"
                if self.keeps_runner_state:
                    self._finished_ids.append(request_id)
            else:
                del self.waiting[request_id]
            request.finished_time = event.time

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def offload_outlives_release() -> Patch:
    def make(original: Any) -> Any:
        def forget(self: StateOffloader, request_ids: Iterable[str]) -> None:
            for request_id in request_ids:
                self._last_ran.pop(request_id, None)
                self._idle_bytes.pop(request_id, None)
                # "its host copies go when it is restored"

        return forget

    return _replace(StateOffloader, "forget", make)


def restore_keeps_the_offload_entry() -> Patch:
    def make(original: Any) -> Any:
        def restore(self: StateOffloader, state: StepRequestState, entry: Any) -> None:
            original(self, state, entry)
            # "keep the host copy: the next preemption can reuse it"
            self._offloaded[state.request.request_id] = entry

        return restore

    return _replace(StateOffloader, "_restore", make)


#: Run by the preemptive core harness.
PREEMPTION_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="resume-starts-over", mode="step", target="preempt",
             bug="a resumed request is sent as a new one and starts over",
             patch=resume_resends_the_payload),
    Mutation(name="preemption-frees-state", mode="step", target="preempt",
             bug="preemption frees the runner state but keeps the step index",
             patch=preemption_frees_runner_state),
    Mutation(name="resume-from-noise", mode="step", target="preempt",
             bug="a resumed request's latents are rebuilt from noise mid-denoise",
             patch=offloaded_latents_rebuilt_from_noise),
    Mutation(name="preempted-in-wave", mode="step", target="preempt",
             bug="a request preempted for a wave still runs in it",
             patch=preempted_runs_in_the_wave),
    Mutation(name="preempted-end-leaks-state", mode="step", target="preempt",
             bug="a request ending while preempted keeps its runner state",
             patch=preempted_end_not_released),
    Mutation(name="offload-outlives-release", mode="step", target="preempt",
             bug="an offloaded state's host copy outlives its request",
             patch=offload_outlives_release),
    Mutation(name="restore-keeps-offload-entry", mode="step", target="preempt",
             bug="a restored state still counts as in host memory",
             patch=restore_keeps_the_offload_entry),
)  # fmt: skip
