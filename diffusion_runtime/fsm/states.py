"""The states a request can be in."""

from __future__ import annotations

import enum


class RequestStatus(str, enum.Enum):
    """Where a request is in its lifecycle.

    The ``FINISHED_*`` states are terminal: once entered, the request accepts no
    further trigger.
    """

    WAITING = "WAITING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    FINISHED_COMPLETED = "FINISHED_COMPLETED"
    FINISHED_ABORTED = "FINISHED_ABORTED"
    FINISHED_ERROR = "FINISHED_ERROR"

    @property
    def is_finished(self) -> bool:
        return self in TERMINAL_STATES

    def __str__(self) -> str:
        return self.value


TERMINAL_STATES: frozenset[RequestStatus] = frozenset(
    {
        RequestStatus.FINISHED_COMPLETED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

#: States of a request that waits for a wave: the deadline of one of them may drop it.
WAITING_STATES: frozenset[RequestStatus] = frozenset(
    {RequestStatus.WAITING, RequestStatus.PREEMPTED}
)

#: States of a request that has started: in step mode the workers may hold its runner state.
STARTED_STATES: frozenset[RequestStatus] = frozenset(
    {RequestStatus.RUNNING, RequestStatus.PREEMPTED}
)

#: The reason of a request aborted because its deadline passed while it waited
#: (``EngineConfig(deadline_miss="drop")``).
DEADLINE_REASON = "deadline"
