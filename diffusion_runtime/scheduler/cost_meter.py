"""WaveCostMeter: times each wave from when its work began to when its results came
back, and teaches the step cost model what its steps, starts and finishes cost."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from diffusion_runtime.contracts import SchedulerOutput
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.step_cost import IDLE_AFTER_S, StepCostModel

#: Waves after a start whose time beyond ordinary steps is its start cost: on digits
#: on a CPU the first three waves after an idle spell are slow (2.5-2.9, 1.6-2.1 and
#: 1.45 ms against 1.2), the fourth is not.
START_WINDOW_WAVES = 3


class _WaveTiming(NamedTuple):
    wave_id: int
    key: Hashable
    batch_size: int
    steps: int
    started: float
    #: Step mode: a request takes its last step in the wave (it also decodes).
    finishes: bool


class _StartWindow(NamedTuple):
    """The waves after requests started on a step-mode engine, being timed."""

    key: Hashable
    request_ids: frozenset[str]
    idle: bool
    batch_size: int
    started: float
    waves_left: int
    #: Waves in it in which a request took its last step (their decodes are no start cost).
    finishes: int


class WaveCostMeter:
    """Feeds a :class:`StepCostModel` the time each wave took.

    A wave is reported twice, with ``now`` on the scheduler's clock: as it is
    built (:meth:`wave_scheduled`; the scheduler's ``build_output`` does this,
    since only it knows which requests a wave starts or resumes) and once its
    results are back (:meth:`wave_ran`; the engine core does this right after
    each execute, so no scheduler has to remember it). A scheduler driven
    without a core needs its driver to call :meth:`wave_ran`, or its model
    learns nothing.
    """

    def __init__(self, costs: StepCostModel, *, step_mode: bool) -> None:
        self._costs = costs
        self._step_mode = step_mode
        self._wave: _WaveTiming | None = None
        self._start_window: _StartWindow | None = None

    def wave_scheduled(
        self,
        wave_id: int,
        new: Sequence[Request],
        cached: Sequence[Request],
        *,
        starts: bool,
        now: float,
    ) -> None:
        """Start timing a wave of ``new`` and ``cached`` requests (``starts``: it
        starts or resumes requests). In step mode only a wave of requests that
        all ran in the previous step is timed: one that starts requests also
        builds their states (several ordinary steps' worth on digits), one that
        resumes them may bring their states back from host memory, and either
        taught the model a step far slower than the ones that follow. A wave in
        which a request takes its last step also decodes its images: what it
        takes beyond an ordinary step is the key's finish cost, not a step.

        A step-mode wave's work begins at the end of the step before it, or at the
        arrival of the first request it starts if that came later: what the
        engine does between two steps (applying results, delivering outputs,
        scheduling) is part of what each step costs a running request, and an
        idle engine's time to take up a request is part of its start. A gap of
        :data:`IDLE_AFTER_S` or more (a pause, control calls) is no such cost:
        the wave's work then begins at its scheduling."""
        size = len(new) + len(cached)
        began, finishes = now, False
        if self._step_mode and size:
            arrived = min((request.arrival_time for request in new), default=None)
            known = [t for t in (self._costs.last_wave_end, arrived) if t is not None]
            began = max(known, default=now)
            if not 0.0 <= now - began < IDLE_AFTER_S:
                began = now
            finishes = any(request.remaining_steps <= 1 for request in (*new, *cached))
            self._watch_start(new, size, now, began, finishes)
            first = None if starts else cached[0]
            steps = 1
        else:
            first = new[0] if new else None
            steps = 0 if first is None else first.params.num_inference_steps
        if first is not None:
            self._wave = _WaveTiming(wave_id, first.batch_key, size, steps, began, finishes)

    def _watch_start(
        self, new: Sequence[Request], size: int, now: float, began: float, finishes: bool
    ) -> None:
        """Step mode: time the :data:`START_WINDOW_WAVES` waves from one that starts
        requests (``size`` in all), for their key's start cost on an idle or a busy
        engine. A wave that starts requests replaces an open window: the engine
        was empty before it (the open window's requests ended first, and the gap
        is no start cost), or the new window, on a busy engine, measures the new
        start. An open window also measures nothing once the engine was idle
        before a wave, or once a wave runs none of the requests it started
        (they ended or were preempted, or another key's wave runs). A wave in it
        in which a request takes its last step (``finishes``) also decodes: the
        key's finish cost is taken off the window's time for each."""
        idle = self._costs.is_idle(now)
        if new:
            started = frozenset(request.request_id for request in new)
            self._start_window = _StartWindow(
                new[0].batch_key, started, idle, size, began, START_WINDOW_WAVES, int(finishes)
            )
        elif idle:
            self._start_window = None
        elif self._start_window is not None and finishes:
            window = self._start_window
            self._start_window = window._replace(finishes=window.finishes + 1)

    def wave_ran(self, output: SchedulerOutput, now: float) -> None:
        """Record that ``output``'s results came back at ``now``: the time since its
        work began goes to the cost model (an output that ran no request, such as
        a release, teaches it nothing)."""
        costs = self._costs
        if output.scheduled_ids:
            costs.wave_ended(now)
        timing = self._wave
        if timing is not None and timing.wave_id == output.wave_id:
            self._wave = None
            seconds = now - timing.started
            if timing.finishes:
                costs.observe_finish(timing.key, timing.batch_size, seconds)
            else:
                costs.observe(timing.key, timing.batch_size, seconds / timing.steps)
        window = self._start_window
        if window is not None and output.scheduled_ids:
            if window.request_ids.isdisjoint(output.scheduled_ids):
                self._start_window = None  # its requests left, or another key's wave ran
                return
            if window.waves_left > 1:
                self._start_window = window._replace(waves_left=window.waves_left - 1)
                return
            self._start_window = None
            step_s = costs.seconds_per_step(window.key, window.batch_size)
            decodes_s = window.finishes * costs.finish_seconds(window.key)
            extra = now - window.started - START_WINDOW_WAVES * step_s - decodes_s
            costs.observe_start(window.key, window.idle, extra)
