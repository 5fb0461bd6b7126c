"""The death monitor: one thread that watches the workers' sentinels and heartbeats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from diffusion_runtime.executor.mp.group import WorkerGroup
from diffusion_runtime.executor.mp.wakeup import WaitingThread

logger = logging.getLogger(__name__)


class DeathMonitor(WaitingThread):
    """Reports the first dead or hung worker to ``on_death`` and stops the other workers.

    A process sentinel becomes readable the moment its process exits, however
    it exits (crash, ``SIGKILL``, the OOM killer), so a death costs no polling.
    A process that is alive but no longer runs (``SIGSTOP``, a deadlock that
    holds the interpreter, a frozen host) stops sending heartbeats: after
    ``liveness_timeout`` seconds without one it is killed and reported as hung.
    The monitor also stops the group when the executor fails for another
    reason (:meth:`stop_workers`), so that never blocks the thread that
    noticed the failure. Closing it means deaths from now on are expected.
    """

    def __init__(
        self,
        group: WorkerGroup,
        on_death: Callable[[str], None],
        grace: float,
        liveness_timeout: float,
    ) -> None:
        super().__init__("diffusion-mp-monitor")
        self._group = group
        self._on_death = on_death
        self._grace = grace
        self._liveness_timeout = liveness_timeout

    def stop_workers(self) -> None:
        """Stop the workers from the monitor thread (the executor has failed)."""
        self._wakeup.set()

    def _run(self) -> None:
        reason = self._watch()
        if self._closing:
            return
        if reason is not None:
            logger.error("worker process lost: %s", reason)
            self._on_death(reason)
        self._group.stop(self._grace)

    def _watch(self) -> str | None:
        """Wait until a worker dies or hangs (its description) or the wakeup is set (None)."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._group.processes)}
        beats = dict(zip(self._group.heartbeat_connections, range(len(sentinels)), strict=True))
        last_beat = dict.fromkeys(range(len(sentinels)), time.monotonic())
        while True:
            timeout = None
            if last_beat:
                oldest = min(last_beat.values())
                timeout = max(0.0, oldest + self._liveness_timeout - time.monotonic())
            ready = wait([self._wakeup.fileno(), *sentinels, *beats], timeout)
            if self._closing:
                return None
            dead = sorted(sentinels[fd] for fd in ready if isinstance(fd, int) and fd in sentinels)
            if dead:
                return "; ".join(self._group.describe_exit(rank) for rank in dead)
            if self._wakeup.fileno() in ready:
                return None
            # Read every beat that has arrived before judging anyone silent.
            for connection, rank in list(beats.items()):
                if _drain(connection):
                    last_beat[rank] = time.monotonic()
                elif connection.closed:  # it exited: its sentinel tells how
                    del beats[connection], last_beat[rank]
            now = time.monotonic()
            silent = sorted(r for r, t in last_beat.items() if now - t >= self._liveness_timeout)
            if silent:
                return "; ".join(self._hung(rank) for rank in silent)

    def _hung(self, rank: int) -> str:
        pid = self._group.processes[rank].pid
        self._group.kill(rank)
        return (
            f"worker {rank} (pid {pid}) stopped answering: no heartbeat for "
            f"{self._liveness_timeout} s (stopped, deadlocked or stuck); it was killed"
        )


def _drain(connection: Connection) -> bool:
    """Read every beat waiting on ``connection``; whether there was one.

    A pipe at end of file is closed here.
    """
    got = False
    try:
        while connection.poll():
            connection.recv_bytes()
            got = True
    except (EOFError, OSError):
        connection.close()
    return got
