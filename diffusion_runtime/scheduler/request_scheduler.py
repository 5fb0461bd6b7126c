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
    more requests. The wait counts from when the wave could first have
    started: the scheduler's first look at it (right after its first
    request arrives when the engine is idle; when the previous wave ends if
    the engine was busy). It ends after ``request_batch_max_wait_ms``, or
    once no request has arrived for ``min(0.3 s, wait / 2)`` (counted from
    that same start at the earliest), whichever comes first. Time spent
    behind another wave does not use up a request's window: otherwise
    clients that send their next request as soon as an answer arrives split
    into groups whose waves alternate, each group's requests too old to wait
    for the other's.
    """

    def __init__(self, machine: RequestMachine[Request], config: EngineConfig) -> None:
        super().__init__(machine, config)
        self.max_wait_s = config.request_batch_max_wait_ms / 1000.0
        self.stable_window_s = min(MAX_STABLE_WINDOW_S, self.max_wait_s / 2)
        self._wakeup_at: float | None = None
        #: When the wave being held back could first have started (None: none is held).
        self._could_start_at: float | None = None

    def schedule(self, now: float) -> SchedulerOutput | None:
        self._wakeup_at = None
        wave = self.plan(now, may_preempt=False)[1]
        if wave and self._should_wait_for_more(wave, now):
            wave = []
        else:
            self._could_start_at = None
        return self.build_output(wave)

    def next_wakeup(self) -> float | None:
        wakeups = [t for t in (self._wakeup_at, super().next_wakeup()) if t is not None]
        return min(wakeups, default=None)

    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[Ended]:
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
        if self._could_start_at is None:  # the first look at this wave
            self._could_start_at = now
        start = self._could_start_at
        newest = next(reversed(self.waiting.values()))
        deadline = start + self.max_wait_s
        stable_at = max(newest.arrival_time, start) + self.stable_window_s
        wake = min(deadline, stable_at)
        if now >= wake:
            return False
        self._wakeup_at = wake
        return True
