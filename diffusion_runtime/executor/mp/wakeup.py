"""A self-pipe that wakes a thread blocked in ``multiprocessing.connection.wait``,
and the waiting thread that owns one."""

from __future__ import annotations

import abc
import contextlib
import os
import threading


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


class WaitingThread(abc.ABC):
    """A daemon thread that blocks in ``connection.wait`` with a :class:`Wakeup`.

    :meth:`close` sets ``_closing``, wakes the thread, joins it (unless called
    from it) and closes the pipe; :meth:`_run` is the thread's body.
    """

    def __init__(self, name: str) -> None:
        self._closing = False
        self._wakeup = Wakeup()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it (unless called from it)."""
        self._closing = True
        self._wakeup.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._wakeup.close()

    @abc.abstractmethod
    def _run(self) -> None: ...
