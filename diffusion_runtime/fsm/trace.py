"""Trace files: events as JSON lines, written by a live engine and read back by the auditor."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

from diffusion_runtime.fsm.events import TraceEvent, event_from_json


class JsonlTraceWriter:
    """An event subscriber that appends each event to a JSON-lines file.

    Writes go through a buffered file under a lock (events come from the loop
    thread and, for admissions, from callers' threads). :meth:`close` flushes
    and closes the file; the engine that opened it closes it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("w", encoding="utf-8", buffering=1 << 16)
        self._lock = threading.Lock()

    def __call__(self, event: TraceEvent) -> None:
        line = json.dumps(event.to_json_dict(), separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_trace(path: str | Path) -> Iterator[TraceEvent]:
    """The events of a trace file, in order; a malformed line raises ``ValueError``
    naming its line number."""
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield event_from_json(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace event: {exc}") from exc
