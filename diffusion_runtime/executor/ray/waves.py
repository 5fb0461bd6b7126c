"""Request ids of waves in flight, and which of them ended while their wave ran."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

import attrs


@attrs.define
class _Wave:
    request_ids: frozenset[str]
    released: set[str] = attrs.field(factory=set)


class WaveTable:
    """Thread-safe: the engine's loop opens and closes waves, its terminal hook releases ids."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waves: dict[int, _Wave] = {}

    def open(self, request_ids: Iterable[str]) -> int:
        with self._lock:
            wave_key = next(self._ids)
            self._waves[wave_key] = _Wave(frozenset(request_ids))
            return wave_key

    def close(self, wave_key: int) -> frozenset[str]:
        """Forget a wave; the ids released while it ran (their outputs are not read)."""
        with self._lock:
            wave = self._waves.pop(wave_key)
            return frozenset(wave.released)

    def release(self, request_id: str) -> None:
        with self._lock:
            for wave in self._waves.values():
                if request_id in wave.request_ids:
                    wave.released.add(request_id)

    def held_request_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(
                rid for wave in self._waves.values() for rid in wave.request_ids - wave.released
            )
