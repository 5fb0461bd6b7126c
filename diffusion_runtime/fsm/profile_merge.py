"""The lifecycle trace and the workers' ``torch.profiler`` traces on one clock.

The two clocks: lifecycle events carry ``time.monotonic()`` (seconds); a
``torch.profiler`` Chrome trace gives ``ts`` in microseconds since its
``baseTimeNanoseconds``, on the wall clock (``ts + baseTimeNanoseconds / 1000``
is ``time.time_ns() / 1000`` at that moment). They differ by the wall clock's
offset from the monotonic one, which only the profiled process can read: at
profile start each worker measures ``time.time_ns() - time.monotonic_ns()`` and
records it in its trace as the name of one slice (:func:`clock_mark`). The
merge reads it back and moves every profiler event onto the lifecycle's clock,
so a kernel sits inside the span of the wave (and under the steps of the
requests) it ran for; the worker labels each wave's slice ``wave <id>`` as the
lifecycle trace does.

Profiler processes and threads get ids of their own (their process ids, and a
device's index on CUDA, could collide with the lifecycle's tracks), named
``<file> rank <r>: <original name>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.fsm.perfetto import chrome_trace, metadata_event, trace_origin
from diffusion_runtime.fsm.violation import Violation

#: The start of the name of the slice that carries a worker's clock offset.
CLOCK_MARK = "diffusion-runtime clock: time_ns - monotonic_ns ="
_MARK = re.compile(re.escape(CLOCK_MARK) + r" (-?\d+)$")
#: A worker's trace file: ``<prefix>-rank<r>.json`` (``runner/profiling.py``).
_TRACE_NAME = re.compile(r"(.+)-rank(\d+)\.json$")
#: Profiler processes are numbered from here (the lifecycle's tracks are 1 and 2).
PROFILE_PID_BASE = 100


class ProfileMergeError(ValueError):
    """A profile directory that cannot be merged; the message says why."""


def clock_mark(time_ns: int, monotonic_ns: int) -> str:
    """The name of the slice a worker records at profile start."""
    return f"{CLOCK_MARK} {time_ns - monotonic_ns}"


@attrs.frozen
class WorkerProfile:
    """One worker's profiler trace, with its events on the monotonic clock (µs)."""

    name: str
    events: list[dict[str, Any]]
    #: The profiler's ``ts`` minus this is the monotonic clock in microseconds.
    shift_us: float

    @classmethod
    def read(cls, path: Path) -> WorkerProfile:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ProfileMergeError(f"cannot read the profile {str(path)!r}: {exc}") from None
        events = document.get("traceEvents") if isinstance(document, dict) else None
        base_ns = document.get("baseTimeNanoseconds") if isinstance(document, dict) else None
        if not isinstance(events, list) or not isinstance(base_ns, int):
            raise ProfileMergeError(
                f"{str(path)!r} is not a torch.profiler trace (no traceEvents, baseTimeNanoseconds)"
            )
        offsets = [
            int(found.group(1))
            for event in events
            if isinstance(event, dict)
            and (found := _MARK.match(str(event.get("name", "")))) is not None
        ]
        if not offsets:
            raise ProfileMergeError(
                f"{str(path)!r} has no clock mark: it was not written by a diffusion-runtime "
                "worker (start_profile), so its clock cannot be aligned"
            )
        # wall µs = ts + base; monotonic µs = wall µs - offset
        shift_us = (offsets[0] - base_ns) / 1000
        match = _TRACE_NAME.match(path.name)
        name = f"{match.group(1)} rank {match.group(2)}" if match else path.stem
        return cls(name, [e for e in events if isinstance(e, dict)], shift_us)

    def start_us(self) -> float | None:
        """The earliest event time on the monotonic clock (µs)."""
        times = [e["ts"] for e in self.events if _is_number(e.get("ts")) and e.get("ph") != "M"]
        return min(times) - self.shift_us if times else None


def read_profiles(profile_dir: str | Path) -> list[WorkerProfile]:
    """Every worker trace (``<prefix>-rank<r>.json``) in ``profile_dir``, sorted by name."""
    directory = Path(profile_dir)
    if not directory.is_dir():
        raise ProfileMergeError(f"--profile {str(directory)!r} is not a directory")
    paths = sorted(p for p in directory.iterdir() if _TRACE_NAME.match(p.name) and p.is_file())
    if not paths:
        raise ProfileMergeError(f"no worker profiles (<prefix>-rank<r>.json) in {str(directory)!r}")
    return [WorkerProfile.read(path) for path in paths]


def merged_trace(
    events: Iterable[TraceEvent],
    violations: Iterable[Violation],
    profiles: list[WorkerProfile],
) -> dict[str, Any]:
    """One Chrome trace of the lifecycle ``events`` and the workers' ``profiles``,
    on the lifecycle's clock (its origin: the earliest moment either saw)."""
    events = list(events)
    starts = [s / 1e6 for s in (p.start_us() for p in profiles) if s is not None]
    origin = min([trace_origin(events), *starts]) if events else min(starts, default=0.0)
    document = chrome_trace(events, violations, origin=origin)
    for number, profile in enumerate(profiles):
        document["traceEvents"].extend(_moved(profile, number, origin * 1e6))
    return document


def _moved(profile: WorkerProfile, number: int, origin_us: float) -> list[dict[str, Any]]:
    """The profile's events with ids of their own, on the lifecycle's clock."""
    pids: dict[Any, int] = {}
    tids: dict[tuple[int, Any], int] = {}
    named_pids: set[int] = set()
    out: list[dict[str, Any]] = []

    def pid_of(pid: Any) -> int:
        if pid not in pids:
            pids[pid] = PROFILE_PID_BASE * (number + 1) + len(pids)
        return pids[pid]

    def tid_of(pid: int, tid: Any) -> int:
        if isinstance(tid, int) and not isinstance(tid, bool):
            return tid
        if (pid, tid) not in tids:
            tids[pid, tid] = len(tids) + 1
            out.append(metadata_event(pid, tids[pid, tid], "thread_name", str(tid)))
        return tids[pid, tid]

    for event in profile.events:
        moved = dict(event)
        pid = pid_of(event.get("pid"))
        moved["pid"] = pid
        if event.get("ph") == "M":
            moved.pop("ts", None)
            if event.get("name") == "process_name":
                original = (event.get("args") or {}).get("name", "")
                moved["args"] = {"name": f"{profile.name}: {original}"}
                named_pids.add(pid)
        elif _is_number(event.get("ts")):
            moved["ts"] = round(event["ts"] - profile.shift_us - origin_us, 3)
        if "tid" in event or event.get("ph") != "M":
            moved["tid"] = tid_of(pid, event.get("tid", 0))
        out.append(moved)
    out.extend(
        metadata_event(pid, None, "process_name", profile.name)
        for pid in pids.values()
        if pid not in named_pids
    )
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
