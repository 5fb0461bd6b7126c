"""A self-pipe that wakes a thread blocked in ``multiprocessing.connection.wait``."""

from __future__ import annotations

import contextlib
import os


class Wakeup:
    """Readable once :meth:`set` is called; pass it to ``connection.wait`` with the rest."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()

    def fileno(self) -> int:
        return self._read_fd

    def set(self) -> None:
        with contextlib.suppress(OSError):  # closed already
            os.write(self._write_fd, b"\0")

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read_fd = self._write_fd = -1
