"""StepScheduler: one denoising step per tick, requests join and leave between steps."""

from __future__ import annotations

from collections.abc import Hashable

from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.fsm import RequestStatus, Trigger
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.base import BaseScheduler, Ended


class StepScheduler(BaseScheduler):
    """Step mode (continuous batching).

    Every tick runs one step for every running request. Waiting requests join
    the running set between steps, up to ``max_num_seqs``, when their step key
    (size, guidance, pipeline options; not the step count) matches the running
    set's; a request leaves as soon as it finishes. The scheduler tracks each
    request's progress but never holds model tensors.

    A preemptive policy may preempt running requests at a step boundary: the
    workers keep their state (they are listed in no output meanwhile), and
    when scheduled again they resume as cached requests at the step they
    reached, so their images are those of an uninterrupted run.
    """

    execution_mode = "step"
    keeps_runner_state = True

    def batch_key_for(self, params: SamplingParams) -> Hashable:
        return params.step_batch_key()

    def schedule(self, now: float) -> SchedulerOutput | None:
        preempt, admit = self.plan(now, may_preempt=True)
        for request in preempt:
            self.machine.fire(request, Trigger.PREEMPT)
        resumed = tuple(r for r in admit if r.state is RequestStatus.PREEMPTED)
        new = [r for r in admit if r.state is not RequestStatus.PREEMPTED]
        cached_ids = (*self.running, *(r.request_id for r in resumed))
        return self.build_output(new, cached_ids, resumed)

    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Ended]:
        fire = self.machine.fire
        wave_id = output.wave_id
        ended = []
        for request_id in output.scheduled_ids:
            request = self.running.get(request_id)
            if request is None:  # aborted during the step
                continue
            error = result.errors.get(request_id)
            progress = result.progress.get(request_id)
            if error is None:
                error = self._progress_error(request.step_index, progress)
            if error is not None:
                ended.append(
                    Ended(request, fire(request, Trigger.FAIL, wave_id=wave_id, reason=error))
                )
                continue
            assert progress is not None
            request.step_index, request.num_steps = progress
            if request.step_index < request.num_steps:
                continue
            images = result.images.get(request_id)
            if images is None or images.shape[0] == 0:
                reason = "the runner finished the last step without images"
                event = fire(request, Trigger.FAIL, wave_id=wave_id, reason=reason)
            else:
                event = fire(request, Trigger.COMPLETE, wave_id=wave_id)
            ended.append(Ended(request, event))
        return ended

    @staticmethod
    def _progress_error(previous: int, progress: tuple[int, int] | None) -> str | None:
        if progress is None:
            return "the runner output has no step index for this request"
        step, total = progress
        if not previous < step <= total:
            return (
                f"the runner reported step {step} of {total} after step {previous}: "
                "outside the request's range"
            )
        return None
