"""Load reports from every replica, which also tell the front which replicas died."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from diffusion_runtime.replicas.router import LoadRouter


class Heartbeat:
    """A thread asking every live replica for its load each interval.

    The answer goes to the router; an actor error, or no answer within
    ``timeout``, marks the replica dead and calls ``on_death(index, reason)``.
    """

    def __init__(
        self,
        replicas: Sequence[Any],
        router: LoadRouter,
        interval: float,
        timeout: float,
        on_death: Callable[[int, str], None],
    ) -> None:
        self._replicas = list(replicas)
        self._router = router
        self._interval = interval
        self._timeout = timeout
        self._on_death = on_death
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="diffusion-replica-heartbeat", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def _beat(self) -> None:
        asked = {self._replicas[i].load.remote(): i for i in self._router.live()}
        deadline = time.monotonic() + self._timeout
        pending = list(asked)
        while pending and not self._stop.is_set():
            wait_s = min(self._interval, max(0.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            for ref in ready:
                index = asked[ref]
                try:
                    self._router.report(index, ray.get(ref))
                except Exception as exc:
                    self._on_death(index, f"replica {index} failed its heartbeat: {exc}")
            if pending and time.monotonic() >= deadline:
                for ref in pending:
                    index = asked[ref]
                    self._on_death(
                        index, f"replica {index} missed its heartbeat ({self._timeout} s)"
                    )
                return
