"""RequestScheduler: one full pipeline forward per wave."""

from __future__ import annotations

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.fsm import RequestMachine, Trigger
from diffusion_runtime.scheduler.base import BaseScheduler, Ended
from diffusion_runtime.scheduler.request import Request

#: The longest quiet period admission coalescing waits for before it gives up on a fuller wave.
MAX_STABLE_WINDOW_S = 0.3


class RequestScheduler(BaseScheduler):
    """Request mode: a wave of compatible requests runs one complete forward,
    and every request of the wave terminates when the wave's output is applied.

    With ``request_batch_max_wait_ms > 0``, a wave that is not full waits for
    more requests until the oldest one has waited that long, or until no new
    request has arrived for ``min(0.3 s, wait / 2)``.
    """

    def __init__(self, machine: RequestMachine[Request], config: EngineConfig) -> None:
        super().__init__(machine, config)
        self.max_wait_s = config.request_batch_max_wait_ms / 1000.0
        self.stable_window_s = min(MAX_STABLE_WINDOW_S, self.max_wait_s / 2)
        self._wakeup_at: float | None = None

    def schedule(self, now: float) -> SchedulerOutput | None:
        self._wakeup_at = None
        wave = self.plan(now, may_preempt=False)[1]
        if wave and self._should_wait_for_more(wave, now):
            wave = []
        return self.build_output(wave)

    def next_wakeup(self) -> float | None:
        wakeups = [t for t in (self._wakeup_at, super().next_wakeup()) if t is not None]
        return min(wakeups, default=None)

    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Ended]:
        self.record_wave_cost(output)
        fire = self.machine.fire
        wave_id = output.wave_id
        ended = []
        for data in output.scheduled_new_reqs:
            request = self.running.get(data.request_id)
            if request is None:  # aborted while the wave ran: its result is dropped
                continue
            images = result.images.get(data.request_id)
            if images is not None and images.shape[0] > 0:
                event = fire(request, Trigger.COMPLETE, wave_id=wave_id)
            else:
                reason = result.errors.get(data.request_id, "the runner returned no output")
                event = fire(request, Trigger.FAIL, wave_id=wave_id, reason=reason)
            ended.append(Ended(request, event))
        return ended

    def _should_wait_for_more(self, wave: list[Request], now: float) -> bool:
        if self.max_wait_s == 0 or len(wave) + len(self.running) >= self.max_num_running_reqs:
            return False
        if len(wave) < len(self.waiting):
            return False  # requests of other keys wait: go now rather than delay them
        deadline = wave[0].arrival_time + self.max_wait_s
        newest = next(reversed(self.waiting.values()))
        stable_at = newest.arrival_time + self.stable_window_s
        wake = min(deadline, stable_at)
        if now >= wake:
            return False
        self._wakeup_at = wake
        return True
