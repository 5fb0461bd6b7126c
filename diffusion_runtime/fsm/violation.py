"""A broken invariant, and the bounded memory checkers keep of finished requests."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

import attrs

from diffusion_runtime.fsm.events import TraceEvent

K = TypeVar("K")
V = TypeVar("V")

#: How many finished requests a checker remembers (an online auditor runs for days).
RECENT_LIMIT = 100_000


class Recent(OrderedDict[K, V]):
    """A dict that forgets its oldest entries beyond :data:`RECENT_LIMIT`.

    Checkers remember finished requests here, so an auditor's memory stays
    bounded; a violation about a request finished long ago may go unseen.
    """

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > RECENT_LIMIT:
            self.popitem(last=False)


@attrs.frozen
class Violation:
    """One broken invariant, with the events that prove it."""

    invariant: str
    request_id: str | None
    message: str
    evidence: tuple[TraceEvent, ...] = ()

    def describe(self) -> str:
        subject = f"request {self.request_id!r}: " if self.request_id is not None else ""
        lines = [f"{self.invariant} {subject}{self.message}"]
        lines.extend(f"    {event.to_json_dict()}" for event in self.evidence)
        return "\n".join(lines)


class InvariantViolation(AssertionError):
    """Raised by an auditor in ``raise`` mode."""

    def __init__(self, violation: Violation) -> None:
        self.violation = violation
        super().__init__(violation.describe())
