"""Bugs that slipped past the earlier catalogues: a runner that fails a whole
batch for one request's own failure, outputs that share memory with a reused
staging buffer, a user's scheduler whose preemption path is wrong, a driving
loop that idles before it checks whether its caller is done, and metrics
that do not add up.

:class:`PriorityPreemptingScheduler` is that user's scheduler, written the way
a user would (passed as ``scheduler_cls``): the core harness must make it
preempt with its default rules, or its preemption path goes untested.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.core import EngineCore
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.runner.host_copy import HostCopier
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.step_scheduler import StepScheduler
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace


class PriorityPreemptingScheduler(StepScheduler):
    """Step mode, lowest ``priority`` first, whatever ``scheduling_policy`` says.

    While nothing waiting outranks a running request it joins waiting requests
    in arrival order. When one does, the best-ranked ``max_num_seqs`` of the
    running requests and the waiting ones of its batch key run, and the
    running requests left out are preempted.
    """

    def plan(self, now: float, *, may_preempt: bool) -> tuple[list[Request], list[Request]]:
        if not self.waiting:
            return [], []
        best = min(self.waiting.values(), key=_by_priority)
        worst_running = max(self.running.values(), key=_by_priority, default=None)
        if not (may_preempt and worst_running and _outranks(best, worst_running)):
            return [], self.next_wave()
        joining = [r for r in self.waiting.values() if r.batch_key == best.batch_key]
        running = [r for r in self.running.values() if r.batch_key == best.batch_key]
        chosen = sorted([*running, *joining], key=_by_priority)[: self.max_num_running_reqs]
        chosen_ids = {r.request_id for r in chosen}
        preempt = [r for r in self.running.values() if r.request_id not in chosen_ids]
        return preempt, [r for r in chosen if r.request_id not in self.running]


def _by_priority(request: Request) -> tuple[int, int]:
    return request.params.priority, request.order


def _outranks(request: Request, other: Request) -> bool:
    return request.params.priority < other.params.priority


def user_scheduler_readmits_the_running() -> Patch:
    def make(original: Any) -> Any:
        def plan(
            self: PriorityPreemptingScheduler, now: float, *, may_preempt: bool
        ) -> tuple[list[Request], list[Request]]:
            preempt, admit = original(self, now, may_preempt=may_preempt)
            if not preempt:
                return preempt, admit
            # "the chosen requests are the ones to schedule"
            kept = [r for r in self.running.values() if r not in preempt]
            return preempt, [*kept, *admit]

        return plan

    return _replace(PriorityPreemptingScheduler, "plan", make)


def missing_result_fails_the_wave() -> Patch:
    def make(original: Any) -> Any:
        def forward(self: ModelRunner, batch: list[PipelineRequest], result: RunnerOutput) -> None:
            original(self, batch, result)
            failed = [r.request_id for r in batch if r.request_id in result.errors]
            if failed:  # "a batch with a bad result cannot be trusted"
                for request in batch:
                    result.images.pop(request.request_id, None)
                    result.errors.setdefault(request.request_id, f"batch mate {failed[0]} failed")

        return forward

    return _replace(ModelRunner, "_forward", make)


def own_step_failure_fails_the_step() -> Patch:
    def make(original: Any) -> Any:
        def step(self: ModelRunner, output: SchedulerOutput, result: RunnerOutput) -> None:
            original(self, output, result)
            failed = [rid for rid in output.scheduled_ids if rid in result.errors]
            if failed:  # "one bad scheduler step means the batch's tensors are suspect"
                for request_id in result.executed:
                    result.errors.setdefault(request_id, f"batch mate {failed[0]} failed")
                    result.images.pop(request_id, None)
                    result.progress.pop(request_id, None)
                result.released.extend(self._release(result.executed))

        return step

    return _replace(ModelRunner, "_step", make)


@contextlib.contextmanager
def staging_buffer_reused() -> Iterator[None]:
    """Host copies land in staging buffers kept per slot of a wave and reused by
    the next wave: outputs already delivered change under their owners."""

    def make_to_host(original: Any) -> Any:
        def to_host(self: HostCopier, tensor: torch.Tensor) -> torch.Tensor:
            slot = self.__dict__.get("_slot", 0)
            self.__dict__["_slot"] = slot + 1
            buffers: dict[Any, torch.Tensor] = self.__dict__.setdefault("_buffers", {})
            key = (slot, tuple(tensor.shape), tensor.dtype)
            if key not in buffers:  # "allocate staging memory once, not per wave"
                buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype)
            return buffers[key].copy_(tensor.detach())

        return to_host

    def make_fence(original: Any) -> Any:
        def fence(self: HostCopier) -> Any:
            self.__dict__["_slot"] = 0
            return original(self)

        return fence

    with _replace(HostCopier, "to_host", make_to_host), _replace(HostCopier, "fence", make_fence):
        yield


def queue_time_until_the_end() -> Patch:
    def make(original: Any) -> Any:
        def final_output(self: EngineCore, ended: Any, images: Any) -> Any:
            request, output = original(self, ended, images)
            metrics = output.metrics
            if request.finished_time is not None:  # "queued from arrival to the end"
                metrics = attrs.evolve(
                    metrics, queue_time_s=request.finished_time - request.arrival_time
                )
            return request, attrs.evolve(output, metrics=metrics)

        return final_output

    return _replace(EngineCore, "_final_output", make)


def drive_idles_before_checking_done() -> Patch:
    def make(original: Any) -> Any:
        def drive(self: DiffusionEngine, done: Callable[[], bool], deadline: float | None) -> None:
            while True:
                self._run_control_calls()
                if self._should_stop(done, deadline):
                    return
                result = self._step_and_deliver()
                self._idle(deadline, result)  # "the next turn checks whether we are done"

        return drive

    return _replace(DiffusionEngine, "_drive", make)


#: The holes a user found in the harness.
GAP_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="missing-result-fails-wave", mode="request", target="core",
             bug="a request's missing result fails its whole wave",
             patch=missing_result_fails_the_wave),
    Mutation(name="own-step-failure-fails-step", mode="step", target="core",
             bug="a request's own failed step fails every request of it",
             patch=own_step_failure_fails_the_step),
    Mutation(name="staging-buffer-reused", mode="request", target="core",
             bug="delivered images share a staging buffer the next wave reuses",
             patch=staging_buffer_reused),
    Mutation(name="user-preemption-readmits", mode="step", target="user-scheduler",
             bug="a user's scheduler schedules a request that is running again when it preempts "
                 "others", patch=user_scheduler_readmits_the_running),
    Mutation(name="queue-time-until-the-end", mode="request", target="core",
             bug="the queue time is measured from arrival to the end",
             patch=queue_time_until_the_end),
    Mutation(name="drive-idles-before-done", mode="step", target="lockstep",
             bug="the driving loop idles after a step before it checks whether its caller is done",
             patch=drive_idles_before_checking_done),
)  # fmt: skip
