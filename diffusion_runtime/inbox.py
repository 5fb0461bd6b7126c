"""CoreInbox: how requests, aborts and pause reach an engine core from any thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs

from diffusion_runtime.errors import DuplicateRequestError
from diffusion_runtime.sampling_params import SamplingParams


@attrs.frozen
class QueuedRequest:
    """A validated request on its way to the scheduler (``arrival_time`` on the core's clock)."""

    request_id: str
    prompt: Any
    params: SamplingParams
    seed: int
    arrival_time: float


@attrs.frozen
class QueuedAbort:
    """Abort these ids, if active when the core takes the abort."""

    request_ids: tuple[str, ...]
    reason: str


Queued = QueuedRequest | QueuedAbort


class CoreInbox:
    """Requests and aborts queued from any thread, taken in order by the core's step.

    Pause holds everything queued. :meth:`take` reads the pause flag and takes
    the queue in one act under one lock, so whatever was queued before
    :meth:`resume` returned is taken together by the first take after it, and
    an abort queued while paused is taken with (after) the requests before it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Queued] = []
        self._request_ids: set[str] = set()
        self._paused = False

    def put_request(self, request: QueuedRequest, check: Callable[[int], None]) -> None:
        """Queue ``request``. Under the lock, ``check(number of requests queued)``
        may refuse it by raising; an id already queued is refused here."""
        with self._lock:
            if request.request_id in self._request_ids:
                raise DuplicateRequestError(
                    f"request id {request.request_id!r} is already queued for admission"
                )
            check(len(self._request_ids))
            self._request_ids.add(request.request_id)
            self._items.append(request)

    def put_abort(self, abort: QueuedAbort) -> None:
        with self._lock:
            self._items.append(abort)

    def take(self) -> list[Queued] | None:
        """Everything queued, in order, and an empty inbox; ``None`` while paused."""
        with self._lock:
            if self._paused:
                return None
            return self._take_locked()

    def take_all(self) -> list[Queued]:
        """Everything queued, paused or not (the core is ending)."""
        with self._lock:
            return self._take_locked()

    def _take_locked(self) -> list[Queued]:
        items, self._items = self._items, []
        self._request_ids.clear()
        return items

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_requests(self) -> int:
        """Requests queued and not taken yet."""
        return len(self._request_ids)

    def has_input(self) -> bool:
        """Whether a take now would return something."""
        with self._lock:
            return bool(self._items) and not self._paused
