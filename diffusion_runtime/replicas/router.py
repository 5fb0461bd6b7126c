"""Choosing a replica for each request from the load the replicas report."""

from __future__ import annotations

import random
import threading

from diffusion_runtime.errors import EngineDeadError


class LoadRouter:
    """Thread-safe table of live replicas and their load.

    A replica's load is the larger of what it last reported (all its
    requests, from any front) and what this front has in flight on it (which
    counts requests sent since that report). ``"least_loaded"`` picks the
    lowest; ``"power_of_two"`` draws two live replicas and picks the lower,
    which spreads a burst without every front herding to the same replica.
    """

    def __init__(self, num_replicas: int, policy: str, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._policy = policy
        self._random = random.Random(seed)
        self._reported = [0] * num_replicas
        self._in_flight = [0] * num_replicas
        self._live = set(range(num_replicas))

    def pick(self) -> int:
        """A live replica for the next request, counted as in flight on it."""
        with self._lock:
            if not self._live:
                raise EngineDeadError("every replica is dead")
            live = sorted(self._live)
            if self._policy == "power_of_two" and len(live) > 2:
                live = self._random.sample(live, 2)
            chosen = min(live, key=self._load)
            self._in_flight[chosen] += 1
            return chosen

    def finished(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def report(self, index: int, load: int) -> None:
        with self._lock:
            self._reported[index] = load

    def mark_dead(self, index: int) -> bool:
        """Stop routing to ``index``; True the first time."""
        with self._lock:
            if index not in self._live:
                return False
            self._live.discard(index)
            return True

    def live(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._live)

    def loads(self) -> list[int]:
        with self._lock:
            return [self._load(index) for index in range(len(self._reported))]

    def _load(self, index: int) -> int:
        return max(self._reported[index], self._in_flight[index])
