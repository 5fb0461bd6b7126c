"""Writing to a worker's pipe without ever blocking for good.

A worker that stops reading (stopped, deadlocked) lets its pipe fill up, and a
plain blocking write would then hang the engine's loop. :class:`PipeWriter`
writes in non-blocking mode and, when the pipe is full, waits for room or for
its group to abandon every write (the executor failed or is shutting down).
"""

from __future__ import annotations

import os
import select
import struct
from multiprocessing.connection import Connection

from diffusion_runtime.errors import EngineDeadError
from diffusion_runtime.executor.mp.wakeup import Wakeup

#: Larger frames use the long header, as ``Connection.send_bytes`` does.
_SHORT_FRAME_MAX = 0x7FFFFFFF
#: Frames up to this size are written with their header in one call.
_JOINED_FRAME_MAX = 16 * 1024


def frame_header(size: int) -> bytes:
    """The length prefix ``Connection.recv_bytes`` reads in front of ``size`` bytes."""
    if size > _SHORT_FRAME_MAX:
        return struct.pack("!i", -1) + struct.pack("!Q", size)
    return struct.pack("!i", size)


class PipeWriter:
    """Sends frames to the write end of a pipe; the reading side uses ``recv_bytes``.

    Not thread-safe: the caller serialises sends. A send that ``abandon`` ends
    halfway leaves the stream broken, so every later send is refused too.
    """

    def __init__(self, connection: Connection, rank: int, abandon: Wakeup) -> None:
        self._connection = connection
        self._fd = connection.fileno()
        self._rank = rank
        os.set_blocking(self._fd, False)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLOUT)
        self._poll.register(abandon.fileno(), select.POLLIN)
        self._broken = False

    def send(self, data: bytes) -> None:
        """Write one frame; :class:`EngineDeadError` if the worker is gone or writes
        were abandoned while the pipe was full."""
        if self._broken:
            raise EngineDeadError(f"the pipe to worker {self._rank} was abandoned mid-frame")
        header = frame_header(len(data))
        parts = (header + data,) if len(data) <= _JOINED_FRAME_MAX else (header, data)
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[self._write_some(view) :]

    def close(self) -> None:
        self._connection.close()

    def _write_some(self, view: memoryview) -> int:
        try:
            return os.write(self._fd, view)
        except BlockingIOError:
            pass
        except OSError as exc:
            self._broken = True
            raise EngineDeadError(f"worker {self._rank} cannot be reached: {exc}") from exc
        for fd, _ in self._poll.poll():
            if fd != self._fd:
                self._broken = True
                raise EngineDeadError(f"the write to worker {self._rank} was abandoned")
        return 0
