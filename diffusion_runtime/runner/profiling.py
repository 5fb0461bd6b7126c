"""One worker's ``torch.profiler`` session, written as one trace file per worker."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from diffusion_runtime.errors import ProfilingError
from diffusion_runtime.fsm.profile_merge import clock_mark

#: A prefix is one plain file-name part, so no caller can write outside ``profile_dir``.
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def checked_profile_prefix(prefix: object) -> str:
    """``prefix`` if it is a safe file-name part, else :class:`ProfilingError`."""
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        raise ProfilingError(
            "a profile prefix must be 1-100 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit; got {prefix!r}"
        )
    return prefix


def profile_trace_path(profile_dir: str, prefix: str, rank: int) -> Path:
    """Where worker ``rank`` writes the trace of profile ``prefix``."""
    return Path(profile_dir) / f"{prefix}-rank{rank}.json"


class WorkerProfiler:
    """Starts and stops ``torch.profiler`` for one worker; the trace is a Chrome
    trace (JSON) that Perfetto and ``chrome://tracing`` read.

    The session records every thread of the process: an in-process worker runs
    on whichever thread drives the engine (the caller of ``generate``, or the
    loop thread), which may not be the thread that started the profile. The
    trace holds one slice named by :func:`~diffusion_runtime.fsm.profile_merge.clock_mark`
    (what aligns it with the lifecycle trace), and one slice per wave, ``wave <id>``.
    """

    def __init__(self, profile_dir: str | None, rank: int, device: torch.device) -> None:
        self.profile_dir = profile_dir
        self.rank = rank
        self._activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self._activities.append(ProfilerActivity.CUDA)
        self._session: profile | None = None
        self._path: Path | None = None

    @property
    def is_profiling(self) -> bool:
        return self._session is not None

    def start(self, prefix: str) -> str:
        """Start profiling; returns the path the trace will be written to."""
        if self.profile_dir is None:
            raise ProfilingError("profiling is off: set EngineConfig(profile_dir=...)")
        if self._session is not None:
            raise ProfilingError("the worker is already profiling; call stop_profile first")
        path = profile_trace_path(self.profile_dir, checked_profile_prefix(prefix), self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        session = profile(
            activities=self._activities,
            record_shapes=True,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        session.start()
        wall_ns, monotonic_ns = time.time_ns(), time.monotonic_ns()
        with record_function(clock_mark(wall_ns, monotonic_ns)):
            pass
        self._session, self._path = session, path
        return str(path)

    def wave(self, wave_id: int) -> contextlib.AbstractContextManager[object]:
        """While profiling, a slice ``wave <id>`` around the wave's work; else nothing."""
        if self._session is None:
            return contextlib.nullcontext()
        return record_function(f"wave {wave_id}")

    def stop(self) -> str:
        """Stop profiling and write the trace; returns its path."""
        session, path = self._session, self._path
        if session is None or path is None:
            raise ProfilingError("the worker is not profiling; call start_profile first")
        self._session = self._path = None
        session.stop()
        session.export_chrome_trace(str(path))
        return str(path)

    def close(self) -> None:
        """Stop a session still running, writing nothing (the worker is shutting down)."""
        session, self._session, self._path = self._session, None, None
        if session is not None:
            session.stop()
