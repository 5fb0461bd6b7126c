"""INV-012: nothing runs while the engine sleeps.

Between an engine event ``sleeping`` and the next ``awake`` the workers have
freed their device memory: no wave may schedule a request and no runner may
execute or advance one. A wave that only tells the workers which ids finished
(an abort applied while asleep) runs nothing, and is allowed.
"""

from __future__ import annotations

from diffusion_runtime.fsm.events import EngineEvent, RunnerEvent, TraceEvent, WaveEvent
from diffusion_runtime.fsm.violation import Violation


class NothingRunsAsleep:
    """No wave schedules, and no runner runs, a request while the engine sleeps."""

    invariant = "INV-012"
    rule = "no wave or step runs between the engine's sleeping and awake events"
    events = (EngineEvent, WaveEvent, RunnerEvent)

    def __init__(self) -> None:
        self._asleep: EngineEvent | None = None

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, EngineEvent):
            if event.state == "sleeping":
                self._asleep = event
            elif event.state == "awake":
                self._asleep = None
            return []
        asleep = self._asleep
        if asleep is None:
            return []
        if isinstance(event, WaveEvent) and event.scheduled_ids:
            ids = list(event.scheduled_ids)
            message = f"wave {event.wave_id} scheduled {ids} while the engine slept"
        elif isinstance(event, RunnerEvent) and (event.executed or event.progressed):
            ids = sorted({*event.executed, *event.progressed})
            message = f"the runner ran {ids} in wave {event.wave_id} while the engine slept"
        else:
            return []
        return [Violation(self.invariant, None, message, (asleep, event))]

    def finish(self, complete: bool) -> list[Violation]:
        return []
