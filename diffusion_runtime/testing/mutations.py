"""Deliberately broken runtime variants: the bugs the harness must catch.

Each mutation patches one method of the real runtime the way a real bug would
look, for as long as its context manager is open. The mutation test runs the
lifecycle harness against each and requires it to fail, and against the
unpatched runtime and requires it to pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import torch
from hypothesis import HealthCheck, Phase
from hypothesis import settings as Settings
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
from diffusion_runtime.testing.deadline_mutations import DEADLINE_MUTATIONS
from diffusion_runtime.testing.gap_mutations import GAP_MUTATIONS
from diffusion_runtime.testing.patching import replace_attribute as _replace
from diffusion_runtime.testing.policy_mutations import POLICY_MUTATIONS
from diffusion_runtime.testing.preemption_mutations import PREEMPTION_MUTATIONS
from diffusion_runtime.testing.runner_mutations import RUNNER_MUTATIONS
from diffusion_runtime.testing.stage_mutations import STAGE_MUTATIONS


@attrs.frozen
class Mutation:
    """A named bug: ``patch()`` applies it while its context is open."""

    name: str
    bug: str
    mode: str
    patch: Callable[[], contextlib.AbstractContextManager[None]]
    #: What the harness drives: ``"core"`` (an EngineCore, uni), ``"mp"`` (an
    #: EngineCore over the mp executor), ``"preempt"`` (an EngineCore under a
    #: preemptive policy), ``"deadline-drop"``/``"deadline-run_late"`` (an
    #: EngineCore on a virtual clock under the ``slo`` policy with that
    #: ``deadline_miss``), ``"deadline-patient"`` (the same under
    #: ``PatientEarliestDeadline``, which does not preempt), ``"front"`` (a
    #: DiffusionEngine), ``"lockstep"`` (a DiffusionEngine the harness drives
    #: itself, racing its loop), ``"stage"`` (a StageClient and its stage process)
    #: or ``"user-scheduler"`` (an EngineCore with a user's preempting
    #: ``scheduler_cls``, under the default core harness).
    target: str = "core"


def results_by_position() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def forward(self: ModelRunner, batch: list[PipelineRequest], result: RunnerOutput) -> None:
            original(self, batch, result)
            ids = [r.request_id for r in batch if r.request_id in result.images]
            images = [result.images[rid] for rid in ids]
            for rid, image in zip(ids, reversed(images), strict=True):
                result.images[rid] = image  # "results come back in batch order"

        return forward

    return _replace(ModelRunner, "_forward", make)


def request_finished_twice() -> contextlib.AbstractContextManager[None]:
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


def runner_state_kept_after_abort() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def release(self: ModelRunner, request_ids: Any) -> list[str]:
            done = [rid for rid in request_ids if rid in self.states and self.states[rid].is_done]
            released: list[str] = original(self, done)  # aborted and failed states stay
            return released

        return release

    return _replace(ModelRunner, "_release", make)


def executor_runs_an_unsent_id() -> contextlib.AbstractContextManager[None]:
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


def stream_not_woken_on_close() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def end_callers(self: DiffusionEngine, error: Any) -> None:
            with self._changed:  # streams are never told the engine ended
                self._routes.close_all()

        return end_callers

    return _replace(DiffusionEngine, "_end_callers", make)


def generator_shared_across_requests() -> contextlib.AbstractContextManager[None]:
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


def cleanup_skipped_on_error() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            if event.dest is RequestStatus.FINISHED_ERROR and event.source is RequestStatus.RUNNING:
                self.running.pop(request.request_id)  # forgot the requests table
                return
            original(self, request, event)

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def error_result_completes() -> contextlib.AbstractContextManager[None]:
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


def wave_reordered() -> contextlib.AbstractContextManager[None]:
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


def wave_truncated() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def execute(self: UniProcExecutor, output: SchedulerOutput) -> RunnerOutput:
            sent = output.scheduled_new_reqs
            if len(sent) > 1:  # an off-by-one in chunking drops the last of a batch
                output = attrs.evolve(output, scheduled_new_reqs=sent[: len(sent) - 1])
            result: RunnerOutput = original(self, output)
            return result

        return execute

    return _replace(UniProcExecutor, "execute", make)


def finished_ids_lost() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            original(self, request, event)
            if event.trigger == Trigger.ABORT.value and self._finished_ids:
                self._finished_ids.pop()  # "aborted requests never reached the workers"

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def aborted_waiting_request_stays_queued() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
            if event.source is RequestStatus.WAITING:  # "only running requests need cleanup"
                del self.requests[request.request_id]
                return
            original(self, request, event)

        return on_terminal

    return _replace(BaseScheduler, "_on_terminal", make)


def error_output_never_delivered() -> contextlib.AbstractContextManager[None]:
    def make(original: Any) -> Any:
        def step(self: EngineCore) -> StepResult:
            result: StepResult = original(self)
            # "errors are logged, not returned"
            kept = [o for o in result.outputs if o.status is not RequestStatus.FINISHED_ERROR]
            return attrs.evolve(result, outputs=kept)

        return step

    return _replace(EngineCore, "_step", make)


_FIRST_CATALOGUE: tuple[Mutation, ...] = (
    Mutation(
        "results-by-position",
        "results mapped to requests by batch position",
        "request",
        results_by_position,
    ),
    Mutation(
        "finished-twice",
        "a failed request is failed a second time",
        "request",
        request_finished_twice,
    ),
    Mutation(
        "state-kept-after-abort",
        "runner step state kept after an abort",
        "step",
        runner_state_kept_after_abort,
    ),
    Mutation(
        "unsent-id-executed",
        "the executor runs an id the scheduler did not send",
        "request",
        executor_runs_an_unsent_id,
    ),
    Mutation(
        "stream-not-woken",
        "open streams are never woken on close",
        "request",
        stream_not_woken_on_close,
        target="front",
    ),
    Mutation(
        "shared-generator",
        "requests with one seed share one generator",
        "request",
        generator_shared_across_requests,
    ),
    Mutation(
        "cleanup-skipped-on-error",
        "scheduler cleanup skipped on the error path",
        "request",
        cleanup_skipped_on_error,
    ),
    Mutation(
        "error-result-completes",
        "an error result counts as success",
        "request",
        error_result_completes,
    ),
    Mutation("wave-reordered", "the runner reorders a wave", "request", wave_reordered),
    Mutation(
        "wave-truncated", "the executor silently drops part of a wave", "request", wave_truncated
    ),
    Mutation("finished-ids-lost", "aborted ids never reach the workers", "step", finished_ids_lost),
    Mutation(
        "aborted-waiting-stays-queued",
        "an aborted waiting request stays queued",
        "request",
        aborted_waiting_request_stays_queued,
    ),
    Mutation(
        "error-never-delivered",
        "a failed request's output is never delivered",
        "request",
        error_output_never_delivered,
    ),
)


#: Every mutation the harness must catch.
CATALOGUE: tuple[Mutation, ...] = _FIRST_CATALOGUE + tuple(
    Mutation(name, bug, mode, patch, target)
    for name, bug, mode, target, patch in (
        *POLICY_MUTATIONS,
        *PREEMPTION_MUTATIONS,
        *DEADLINE_MUTATIONS,
        *STAGE_MUTATIONS,
        *GAP_MUTATIONS,
        *RUNNER_MUTATIONS,
    )
)


def hunt_settings(max_examples: int = 60, steps: int = 20) -> Settings:
    """What :func:`hunt` runs a harness with: derandomized, no shrinking, no
    example database, so the same examples run every time."""
    return Settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        phases=[Phase.generate],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )


def passes(machine: type[RuleBasedStateMachine], max_examples: int = 60, steps: int = 20) -> None:
    """Run the harness ``machine`` against the real runtime as :func:`hunt` would;
    a failing example is raised with hypothesis's report (its rules and draws, and
    the ``@reproduce_failure`` blob that replays it alone)."""
    settings = Settings(hunt_settings(max_examples, steps), print_blob=True)
    run_state_machine_as_test(machine, settings=settings)


def hunt(
    mutation: Mutation | None,
    machine: type[RuleBasedStateMachine],
    max_examples: int = 60,
    steps: int = 20,
) -> int | None:
    """Run the harness ``machine`` with ``mutation`` applied (``None``: the real runtime).

    Returns how many examples it took to fail, or ``None`` if every example passed.
    Deterministic (derandomized, no shrinking, no example database).
    """
    examples = 0
    original_init = machine.__init__

    def counting_init(self: Any) -> None:
        nonlocal examples
        examples += 1
        original_init(self)

    settings = hunt_settings(max_examples, steps)
    patch = mutation.patch() if mutation is not None else contextlib.nullcontext()
    machine.__init__ = counting_init  # type: ignore[method-assign]
    try:
        with patch:
            run_state_machine_as_test(machine, settings=settings)
    except Exception:
        return examples
    finally:
        machine.__init__ = original_init  # type: ignore[method-assign]
    return None
