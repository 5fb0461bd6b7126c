"""The liveness bound: every worker answers a ping within a timeout, or is taken for dead.

Ray reports an actor whose process or node ended (``ActorDiedError``), but a
node that hangs or drops off the network may stay "alive" to Ray for many
seconds. Pings run in the actors' side group, so a long wave does not delay
them: a ping unanswered for ``ray_liveness_timeout_s`` means the worker is
unreachable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

# Pings are sent this many times per timeout, and at least once a second.
_PINGS_PER_TIMEOUT = 4


class LivenessMonitor:
    """A thread that pings every actor and reports the first one that is lost or silent."""

    def __init__(
        self, actors: Sequence[Any], timeout: float, report: Callable[[str], None]
    ) -> None:
        self._actors = list(actors)
        self._timeout = timeout
        self._period = min(1.0, timeout / _PINGS_PER_TIMEOUT)
        self._report = report
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="diffusion-ray-liveness", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop pinging and wait for the thread. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            problem = self._ping_all()
            if problem is not None:
                if not self._stop.is_set():
                    self._report(problem)
                return

    def _ping_all(self) -> str | None:
        pings = {actor.ping.remote(): rank for rank, actor in enumerate(self._actors)}
        deadline = time.monotonic() + self._timeout
        pending = list(pings)
        while pending and not self._stop.is_set():
            wait_s = min(self._period, max(0.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # a ping cannot fail but by losing the worker
                    return f"worker {pings[ref]} was lost: {exc}"
            if pending and time.monotonic() >= deadline:
                ranks = sorted(pings[ref] for ref in pending)
                return f"workers {ranks} did not answer a liveness ping within {self._timeout} s"
        return None
