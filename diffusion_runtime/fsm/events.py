"""Lifecycle events: the record every transition leaves behind."""

from __future__ import annotations

import attrs

from diffusion_runtime.fsm.states import RequestStatus

#: The pseudo-trigger recorded when a request enters the machine.
ADMIT = "admit"


@attrs.frozen(slots=True)
class LifecycleEvent:
    """One transition of one request.

    ``source`` is ``None`` for admission. ``wave_id`` names the scheduler output
    the transition belongs to, when there is one. ``time`` is
    ``time.monotonic()`` at the moment of the transition. ``rejected`` marks an
    attempted transition the machine refused (the state did not change).
    """

    request_id: str
    source: RequestStatus | None
    dest: RequestStatus
    trigger: str
    wave_id: int | None
    time: float
    reason: str | None = None
    rejected: bool = False

    def to_json_dict(self) -> dict[str, object]:
        return {
            "kind": "lifecycle",
            "request_id": self.request_id,
            "source": None if self.source is None else self.source.value,
            "dest": self.dest.value,
            "trigger": self.trigger,
            "wave_id": self.wave_id,
            "time": self.time,
            "reason": self.reason,
            "rejected": self.rejected,
        }
