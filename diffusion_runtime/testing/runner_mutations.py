"""Bugs in the runner's batched step path, the one taken when a pipeline has
``step_batch`` (and ``post_decode_batch``): what a contributor gets wrong in
``ModelRunner._run_step_batch`` and in how it fails one request of the step.

The core harness reaches that path in the examples where it draws
``batched_steps`` for the ``testing-faults`` pipeline. Without that draw no
pipeline the harness runs has ``step_batch``: ``_run_step_batch`` never runs,
and no per-request step leaves a request's index in place (``bad-step``
raises there), so the branch ``stuck_state_left_to_the_scheduler`` plants in
the shared ``_report`` is never taken either.

Left out: bugs that need a batched decode while a request of the same step
is still running (images matched to the step's requests by position, a
decode that frees the whole step), which the suite's ``max_num_seqs=2``
never gives; and progress counted before a batched step that then fails
(equivalent: the scheduler fails a request with an error whatever its
progress says, and the core sends no progress of a request that ended).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diffusion_runtime.contracts import RunnerOutput
from diffusion_runtime.errors import describe_error
from diffusion_runtime.pipelines.protocols import StepPipeline, StepRequestState
from diffusion_runtime.runner.input_batch import InputBatch
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace

_StepBatch = Callable[[InputBatch], None]


def stuck_state_fails_the_batched_step() -> Patch:
    def make(original: Any) -> Any:
        def run(
            self: ModelRunner,
            step_batch: _StepBatch,
            pipeline: StepPipeline,
            batch: InputBatch,
            before: list[int],
            result: RunnerOutput,
        ) -> None:
            original(self, step_batch, pipeline, batch, before, result)
            stuck = [s.request_id for s, i in zip(batch, before, strict=True) if s.step_index == i]
            if stuck:  # "a batched step that left a state behind went wrong as a whole"
                for state in batch:
                    rid = state.request_id
                    result.errors.setdefault(rid, f"batch mate {stuck[0]} did not advance")
                    result.images.pop(rid, None)
                    result.progress.pop(rid, None)
                    result.previews.pop(rid, None)

        return run

    return _replace(ModelRunner, "_run_step_batch", make)


def stuck_state_left_to_the_scheduler() -> Patch:
    def make(original: Any) -> Any:
        def report(
            self: ModelRunner,
            state: StepRequestState,
            before: int,
            result: RunnerOutput,
            finished: list[StepRequestState],
        ) -> None:
            if state.step_index == before:  # "the scheduler fails a step that did not advance"
                result.progress[state.request_id] = (before, state.num_steps)
                return
            original(self, state, before, result, finished)

        return report

    return _replace(ModelRunner, "_report", make)


def batched_device_fault_kept_local() -> Patch:
    def make(original: Any) -> Any:
        def run(
            self: ModelRunner,
            step_batch: _StepBatch,
            pipeline: StepPipeline,
            batch: InputBatch,
            before: list[int],
            result: RunnerOutput,
        ) -> None:
            try:
                step_batch(batch)
            except Exception as exc:  # "a failed batched step fails its requests"
                for request_id in batch.request_ids:
                    result.errors[request_id] = describe_error(exc)
                return
            # The step ran: report and decode it as the runner does.
            original(self, lambda states: None, pipeline, batch, before, result)

        return run

    return _replace(ModelRunner, "_run_step_batch", make)


#: ``(name, bug, mode, target, patch)``.
RUNNER_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="batched-stuck-state-fails-step", mode="step", target="core",
             bug="a state that step_batch leaves behind fails every request of the batched step",
             patch=stuck_state_fails_the_batched_step),
    Mutation(name="stuck-state-left-to-scheduler", mode="step", target="core",
             bug="a request its step left behind is failed by the scheduler alone, and the "
             "runner keeps its step state",
             patch=stuck_state_left_to_the_scheduler),
    Mutation(name="batched-device-fault-kept-local", mode="step", target="core",
             bug="a device fault in step_batch fails the step's requests instead of the executor",
             patch=batched_device_fault_kept_local),
)  # fmt: skip
