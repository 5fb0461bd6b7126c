"""A trace as Chrome trace-event JSON, viewable in Perfetto (ui.perfetto.dev) or chrome://tracing.

One track per request (its states as spans), one track of waves (each wave a
span from its scheduling to its runner report), and violations as instant
events on the track of the request they concern.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diffusion_runtime.fsm.events import LifecycleEvent, RunnerEvent, TraceEvent, WaveEvent
from diffusion_runtime.fsm.violation import Violation

REQUESTS_PID = 1
WAVES_PID = 2


def trace_origin(events: Iterable[TraceEvent]) -> float:
    """The time of the earliest event (``0.0`` for none): the trace's zero."""
    return min((e.time for e in events), default=0.0)


def chrome_trace(
    events: Iterable[TraceEvent],
    violations: Iterable[Violation] = (),
    *,
    origin: float | None = None,
) -> dict[str, Any]:
    """The ``{"traceEvents": [...]}`` document of ``events`` and the ``violations`` in them;
    timestamps count microseconds from ``origin`` (default: :func:`trace_origin`)."""
    events = list(events)
    if origin is None:
        origin = trace_origin(events)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    out: list[dict[str, Any]] = [
        metadata_event(REQUESTS_PID, None, "process_name", "requests"),
        metadata_event(WAVES_PID, None, "process_name", "waves"),
        metadata_event(WAVES_PID, 0, "thread_name", "waves"),
    ]
    tracks: dict[str, int] = {}
    open_state: dict[str, LifecycleEvent] = {}
    open_wave: dict[int, WaveEvent] = {}
    end = max((e.time for e in events), default=origin)

    def track(rid: str) -> int:
        if rid not in tracks:
            tracks[rid] = len(tracks) + 1
            out.append(metadata_event(REQUESTS_PID, tracks[rid], "thread_name", rid))
        return tracks[rid]

    def close_state(rid: str, until: float) -> None:
        began = open_state.pop(rid, None)
        if began is not None:
            out.append(_span(REQUESTS_PID, track(rid), began.dest.name, us(began.time), us(until)))

    for event in events:
        if isinstance(event, LifecycleEvent) and not event.rejected:
            close_state(event.request_id, event.time)
            if event.dest.is_finished:
                out.append(
                    _instant(REQUESTS_PID, track(event.request_id), event.dest.name, us(event.time))
                )
            else:
                open_state[event.request_id] = event
        elif isinstance(event, WaveEvent):
            open_wave[event.wave_id] = event
        elif isinstance(event, RunnerEvent):
            wave = open_wave.pop(event.wave_id, None)
            if wave is not None:
                span = _span(WAVES_PID, 0, f"wave {wave.wave_id}", us(wave.time), us(event.time))
                span["args"] = {"scheduled": list(wave.scheduled_ids), "failed": list(event.failed)}
                out.append(span)
    for rid in list(open_state):
        close_state(rid, end)
    for violation in violations:
        when = max((e.time for e in violation.evidence), default=end)
        subject = violation.request_id
        pid, tid = (REQUESTS_PID, track(subject)) if subject is not None else (WAVES_PID, 0)
        instant = _instant(pid, tid, f"{violation.invariant} violated", us(when))
        instant["args"] = {"message": violation.message}
        out.append(instant)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def metadata_event(pid: int, tid: int | None, kind: str, name: str) -> dict[str, Any]:
    """A ``ph: M`` record naming a process (``process_name``) or a thread."""
    record: dict[str, Any] = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        record["tid"] = tid
    return record


def _span(pid: int, tid: int, name: str, start_us: float, end_us: float) -> dict[str, Any]:
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "ts": start_us,
        "dur": max(end_us - start_us, 0.0),
    }


def _instant(pid: int, tid: int, name: str, at_us: float) -> dict[str, Any]:
    return {"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": name, "ts": at_us}
