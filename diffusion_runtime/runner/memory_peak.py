"""The memory high-water mark of one wave on one worker.

On CUDA it is the device's peak allocated memory, whose counter the meter
resets when a wave begins. On the CPU it is the worker process's resident-set
high-water mark (``VmHWM``), which Linux resets when ``5`` is written to
``/proc/self/clear_refs``. Where neither can be read (another OS), the meter
reports nothing. The reset is process-wide: two engines running waves at once
in one process each see the other's peak too.
"""

from __future__ import annotations

import os

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


class PeakMemoryMeter:
    """Reset at :meth:`begin`, read at :meth:`peak_bytes`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pid = -1
        self._clear_fd = -1
        self._status_fd = -1

    def begin(self) -> None:
        """Start a new high-water mark from the memory in use now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._open():
            try:
                os.write(self._clear_fd, b"5")
            except OSError:  # a kernel or sandbox that refuses the reset: report nothing
                self.close()

    def peak_bytes(self) -> int | None:
        """The high-water mark since :meth:`begin`, in bytes (``None``: unknown here)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if not self._open():
            return None
        status = os.pread(self._status_fd, 8192, 0)
        start = status.find(b"VmHWM:")
        if start < 0:
            return None
        return int(status[start + 6 : status.index(b"kB", start)]) * 1024

    def close(self) -> None:
        """Close the files the meter holds open."""
        for fd in (self._clear_fd, self._status_fd):
            if fd >= 0 and self._pid == os.getpid():
                os.close(fd)
        self._clear_fd = self._status_fd = -1

    def _open(self) -> bool:
        """Open this process's files once (again in a forked child); False where
        the OS has none."""
        if self._pid == os.getpid():
            return self._clear_fd >= 0
        self._pid = os.getpid()
        try:
            self._clear_fd = os.open(_CLEAR_REFS, os.O_WRONLY)
        except OSError:
            self._clear_fd = -1
            return False
        try:
            self._status_fd = os.open(_STATUS, os.O_RDONLY)
        except OSError:
            os.close(self._clear_fd)
            self._clear_fd = -1
            return False
        return True
