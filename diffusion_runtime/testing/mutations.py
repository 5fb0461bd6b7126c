"""Deliberately broken runtime variants: the bugs the harness must catch.

Each mutation patches one method of the real runtime the way a real bug would
look, for as long as its context manager is open. The mutation test runs the
lifecycle harness against each and requires it to fail, and against the
unpatched runtime and requires it to pass. Each names the harness target that
catches it (:mod:`.targets` resolves it), so :func:`hunt` runs any of them by name.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import attrs
import torch
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from diffusion_runtime.contracts import NewRequestData, RunnerOutput, SchedulerOutput
from diffusion_runtime.core import EngineCore, StepResult
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.executor.uni import UniProcExecutor
from diffusion_runtime.fsm import LifecycleEvent, RequestStatus, Trigger
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.scheduler.base import BaseScheduler, Ended
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.testing.cache_mutations import CACHE_MUTATIONS
from diffusion_runtime.testing.deadline_mutations import DEADLINE_MUTATIONS
from diffusion_runtime.testing.delivery_mutations import DELIVERY_MUTATIONS
from diffusion_runtime.testing.gap_mutations import GAP_MUTATIONS
from diffusion_runtime.testing.group_mutations import GROUP_MUTATIONS
from diffusion_runtime.testing.lora_mutations import LORA_MUTATIONS
from diffusion_runtime.testing.mutation import Mutation as Mutation
from diffusion_runtime.testing.mutation import Patch
from diffusion_runtime.testing.output_mutations import OUTPUT_MUTATIONS
from diffusion_runtime.testing.parallel_mutations import PARALLEL_MUTATIONS
from diffusion_runtime.testing.patching import replace_attribute as _replace
from diffusion_runtime.testing.policy_mutations import POLICY_MUTATIONS
from diffusion_runtime.testing.preemption_mutations import PREEMPTION_MUTATIONS
from diffusion_runtime.testing.profiles import harness_settings
from diffusion_runtime.testing.replay import ChoiceRecorder, record_failure
from diffusion_runtime.testing.replay_file import NotReplayable, TargetRecipe
from diffusion_runtime.testing.runner_mutations import RUNNER_MUTATIONS
from diffusion_runtime.testing.schedule_mutations import SCHEDULE_MUTATIONS
from diffusion_runtime.testing.sleep_mutations import SLEEP_MUTATIONS
from diffusion_runtime.testing.stage_mutations import STAGE_MUTATIONS
from diffusion_runtime.testing.targets import harness_for


def results_by_position() -> Patch:
    def make(original: Any) -> Any:
        def forward(self: ModelRunner, batch: list[PipelineRequest], result: RunnerOutput) -> None:
            original(self, batch, result)
            ids = [r.request_id for r in batch if r.request_id in result.images]
            images = [result.images[rid] for rid in ids]
            for rid, image in zip(ids, reversed(images), strict=True):
                result.images[rid] = image  # "results come back in batch order"

        return forward

    return _replace(ModelRunner, "_forward", make)


def request_finished_twice() -> Patch:
    def make(original: Any) -> Any:
        def update(
            self: RequestScheduler, output: SchedulerOutput, result: RunnerOutput
        ) -> list[Ended]:
            running = [
                self.running[d.request_id]
                for d in output.scheduled_new_reqs
                if d.request_id in self.running
            ]
            ended: list[Ended] = original(self, output, result)
            for request in running:
                if request.request_id in result.errors:  # "make sure failures are final"
                    self.machine.fire(request, Trigger.FAIL, reason="failed")
            return ended

        return update

    return _replace(RequestScheduler, "update_from_output", make)


def runner_state_kept_after_abort() -> Patch:
    def make(original: Any) -> Any:
        def release(self: ModelRunner, request_ids: Any) -> list[str]:
            done = [rid for rid in request_ids if rid in self.states and self.states[rid].is_done]
            released: list[str] = original(self, done)  # aborted and failed states stay
            return released

        return release

    return _replace(ModelRunner, "_release", make)


def executor_runs_an_unsent_id() -> Patch:
    def make(original: Any) -> Any:
        def execute(self: UniProcExecutor, output: SchedulerOutput) -> RunnerOutput:
            seen: list[NewRequestData] = self.__dict__.setdefault("_sent", [])
            sent = output.scheduled_new_reqs
            if seen and sent:  # "retry the last request that was sent"
                output = attrs.evolve(output, scheduled_new_reqs=(*sent, seen[-1]))
            seen.extend(sent)
            result: RunnerOutput = original(self, output)
            return result

        return execute

    return _replace(UniProcExecutor, "execute", make)


def stream_not_woken_on_close() -> Patch:
    def make(original: Any) -> Any:
        def end_callers(self: DiffusionEngine, error: Any) -> None:
            with self._changed:  # streams are never told the engine ended
                self._routes.close_all()

        return end_callers

    return _replace(DiffusionEngine, "_end_callers", make)


def generator_shared_across_requests() -> Patch:
    def make(original: Any) -> Any:
        def pipeline_request(self: ModelRunner, data: NewRequestData) -> PipelineRequest:
            request: PipelineRequest = original(self, data)
            shared = self.__dict__.setdefault("_shared", {})
            key = data.seed  # "one generator per seed is enough"
            if key not in shared:
                shared[key] = torch.Generator(device=self.device).manual_seed(data.seed)
            request._generator = shared[key]
            return request

        return pipeline_request

    return _replace(ModelRunner, "_pipeline_request", make)


def cleanup_skipped_on_error() -> Patch:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            if event.dest is RequestStatus.FINISHED_ERROR and event.source is RequestStatus.RUNNING:
                self.running.pop(request.request_id)  # forgot the requests table
                return
            original(self, request, event)

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def error_result_completes() -> Patch:
    def make(original: Any) -> Any:
        def update(
            self: RequestScheduler, output: SchedulerOutput, result: RunnerOutput
        ) -> list[Ended]:
            for request_id in list(result.errors):  # "errors were logged by the runner already"
                del result.errors[request_id]
                result.images[request_id] = torch.zeros(1, 1, 1, 1)
            ended: list[Ended] = original(self, output, result)
            return ended

        return update

    return _replace(RequestScheduler, "update_from_output", make)


def wave_reordered() -> Patch:
    def make(original: Any) -> Any:
        def forward_wave(self: ModelRunner, output: SchedulerOutput, result: RunnerOutput) -> None:
            reordered = attrs.evolve(  # "largest requests first packs better"
                output,
                scheduled_new_reqs=tuple(
                    sorted(
                        output.scheduled_new_reqs, key=lambda d: -d.params.num_outputs_per_prompt
                    )
                ),
            )
            original(self, reordered, result)

        return forward_wave

    return _replace(ModelRunner, "_forward_wave", make)


def wave_truncated() -> Patch:
    def make(original: Any) -> Any:
        def execute(self: UniProcExecutor, output: SchedulerOutput) -> RunnerOutput:
            sent = output.scheduled_new_reqs
            if len(sent) > 1:  # an off-by-one in chunking drops the last of a batch
                output = attrs.evolve(output, scheduled_new_reqs=sent[: len(sent) - 1])
            result: RunnerOutput = original(self, output)
            return result

        return execute

    return _replace(UniProcExecutor, "execute", make)


def finished_ids_lost() -> Patch:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            original(self, request, event)
            if event.trigger == Trigger.ABORT.value and self._finished_ids:
                self._finished_ids.pop()  # "aborted requests never reached the workers"

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def aborted_waiting_request_stays_queued() -> Patch:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            if event.source is RequestStatus.WAITING:  # "only running requests need cleanup"
                del self.requests[request.request_id]
                return
            original(self, request, event)

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def error_output_never_delivered() -> Patch:
    def make(original: Any) -> Any:
        def step(self: EngineCore) -> StepResult:
            result: StepResult = original(self)
            # "errors are logged, not returned"
            kept = [o for o in result.outputs if o.status is not RequestStatus.FINISHED_ERROR]
            return attrs.evolve(result, outputs=kept)

        return step

    return _replace(EngineCore, "_step", make)


_FIRST_CATALOGUE: tuple[Mutation, ...] = (
    Mutation(name="results-by-position", mode="request", target="core",
             bug="results mapped to requests by batch position", patch=results_by_position),
    Mutation(name="finished-twice", mode="request", target="core",
             bug="a failed request is failed a second time", patch=request_finished_twice),
    Mutation(name="state-kept-after-abort", mode="step", target="core",
             bug="runner step state kept after an abort", patch=runner_state_kept_after_abort),
    Mutation(name="unsent-id-executed", mode="request", target="core",
             bug="the executor runs an id the scheduler did not send",
             patch=executor_runs_an_unsent_id),
    Mutation(name="stream-not-woken", mode="request", target="front",
             bug="open streams are never woken on close", patch=stream_not_woken_on_close),
    Mutation(name="shared-generator", mode="request", target="core",
             bug="requests with one seed share one generator",
             patch=generator_shared_across_requests),
    Mutation(name="cleanup-skipped-on-error", mode="request", target="core",
             bug="scheduler cleanup skipped on the error path", patch=cleanup_skipped_on_error),
    Mutation(name="error-result-completes", mode="request", target="core",
             bug="an error result counts as success", patch=error_result_completes),
    Mutation(name="wave-reordered", mode="request", target="core", bug="the runner reorders a wave",
             patch=wave_reordered),
    Mutation(name="wave-truncated", mode="request", target="core",
             bug="the executor silently drops part of a wave", patch=wave_truncated),
    Mutation(name="finished-ids-lost", mode="step", target="core",
             bug="aborted ids never reach the workers", patch=finished_ids_lost),
    Mutation(name="aborted-waiting-stays-queued", mode="request", target="core",
             bug="an aborted waiting request stays queued",
             patch=aborted_waiting_request_stays_queued),
    Mutation(name="error-never-delivered", mode="request", target="core",
             bug="a failed request's output is never delivered",
             patch=error_output_never_delivered),
)  # fmt: skip


#: Every mutation the harness must catch.
CATALOGUE: tuple[Mutation, ...] = (
    *_FIRST_CATALOGUE,
    *POLICY_MUTATIONS,
    *PREEMPTION_MUTATIONS,
    *DEADLINE_MUTATIONS,
    *STAGE_MUTATIONS,
    *GAP_MUTATIONS,
    *DELIVERY_MUTATIONS,
    *RUNNER_MUTATIONS,
    *LORA_MUTATIONS,
    *SLEEP_MUTATIONS,
    *OUTPUT_MUTATIONS,
    *SCHEDULE_MUTATIONS,
    *PARALLEL_MUTATIONS,
    *GROUP_MUTATIONS,
    *CACHE_MUTATIONS,
)


def named(name: str) -> Mutation:
    """The mutation of :data:`CATALOGUE` called ``name``."""
    for mutation in CATALOGUE:
        if mutation.name == name:
            return mutation
    raise KeyError(f"no mutation named {name!r} in the catalogue")


def passes(machine: type[RuleBasedStateMachine], max_examples: int = 60, steps: int = 20) -> None:
    """Run the harness ``machine`` against the real runtime as :func:`hunt` would;
    a failing example is raised with hypothesis's report (its rules and draws, and
    the ``@reproduce_failure`` blob that replays it alone)."""
    settings = harness_settings("hunt", max_examples=max_examples, stateful_step_count=steps)
    run_state_machine_as_test(machine, settings=settings)


def hunt(
    mutation: Mutation | None,
    machine: type[RuleBasedStateMachine] | None = None,
    max_examples: int = 60,
    steps: int = 20,
    replay_dir: Path | None = None,
) -> int | None:
    """Run the harness ``machine`` (by default the mutation's target's, in its
    mode) with ``mutation`` applied (``None``: the real runtime).

    Returns how many examples it took to fail, or ``None`` if every example passed.
    Deterministic (derandomized, no shrinking, no example database). With
    ``replay_dir``, the failing example of a catalogue mutation hunted on its own
    target's harness is written there as ``NAME.replay.json``, which
    :func:`~diffusion_runtime.testing.replay.rerun` (``diffusion-runtime audit
    --replay``) reruns with the mutation applied.
    """
    own_target = machine is None
    if machine is None:
        if mutation is None:
            raise ValueError("hunt needs a harness machine, or a mutation to name its target")
        machine = harness_for(mutation.target, mutation.mode)

    def recipe() -> TargetRecipe:
        if mutation is None or not own_target or mutation not in CATALOGUE:
            raise NotReplayable("only a catalogue mutation hunted on its own target replays")
        return TargetRecipe(mutation.target, mutation.mode, mutation.name)

    examples = 0
    original_init = machine.__init__

    def counting_init(self: Any) -> None:
        nonlocal examples
        examples += 1
        original_init(self)

    settings, recorder = ChoiceRecorder.around(
        harness_settings("hunt", max_examples=max_examples, stateful_step_count=steps)
    )
    patch = mutation.patch() if mutation is not None else contextlib.nullcontext()
    machine.__init__ = counting_init  # type: ignore[method-assign]
    try:
        with patch:  # a patch that no longer applies raises here: it is no catch
            try:
                run_state_machine_as_test(machine, settings=settings)
            except Exception as exc:
                if replay_dir is not None:
                    record_failure(exc, replay_dir, recipe, settings, recorder)
                return examples
    finally:
        machine.__init__ = original_init  # type: ignore[method-assign]
    return None
