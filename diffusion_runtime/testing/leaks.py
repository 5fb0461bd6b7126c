"""What a test may leave behind: child processes, threads, stage socket directories
and process-group rendezvous directories.

:class:`Leftovers` takes a baseline before the code under test runs and
names, afterwards, what it started and did not release.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import attrs

from diffusion_runtime.executor.mp.executor import RENDEZVOUS_PREFIX
from diffusion_runtime.stage.endpoints import SOCKET_DIR_PREFIX

#: How long released resources may take to disappear (a process being reaped).
SETTLE_S = 10.0


def child_pids() -> set[int]:
    """Live child processes of this one (from /proc), except multiprocessing's resource tracker."""
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == me and b"resource_tracker" not in cmdline:
            found.add(int(entry))
    return found


def stage_socket_dirs() -> set[str]:
    """This process's stage socket directories (named by their owner's pid)."""
    pattern = f"{SOCKET_DIR_PREFIX}{os.getpid()}-*"
    return {p.name for p in Path(tempfile.gettempdir()).glob(pattern)}


def rendezvous_dirs() -> set[str]:
    """The ``torch.distributed`` rendezvous directories of this process's mp executors."""
    pattern = f"{RENDEZVOUS_PREFIX}{os.getpid()}-*"
    return {p.name for p in Path(tempfile.gettempdir()).glob(pattern)}


@attrs.frozen
class Leftovers:
    """A baseline of processes, threads and directories; :meth:`since` names
    what appeared after it and is still there once ``SETTLE_S`` has passed."""

    children: frozenset[int]
    threads: frozenset[threading.Thread]
    socket_dirs: frozenset[str]
    rendezvous_dirs: frozenset[str]

    @classmethod
    def baseline(cls) -> Leftovers:
        threads = frozenset(threading.enumerate())
        return cls(
            frozenset(child_pids()),
            threads,
            frozenset(stage_socket_dirs()),
            frozenset(rendezvous_dirs()),
        )

    def since(self, settle_s: float = SETTLE_S) -> list[str]:
        """What is left beyond the baseline, in words (empty: nothing)."""
        deadline = time.monotonic() + settle_s
        while True:
            left = self._left()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.01)

    def _left(self) -> list[str]:
        processes = child_pids() - self.children
        threads = [t.name for t in threading.enumerate() if t not in self.threads]
        dirs = stage_socket_dirs() - self.socket_dirs
        rendezvous = rendezvous_dirs() - self.rendezvous_dirs
        return [
            *(f"child process {pid}" for pid in sorted(processes)),
            *(f"thread {name!r}" for name in sorted(threads)),
            *(f"socket directory {name}" for name in sorted(dirs)),
            *(f"rendezvous directory {name}" for name in sorted(rendezvous)),
        ]
