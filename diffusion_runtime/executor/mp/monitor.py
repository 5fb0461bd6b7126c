"""The death monitor: one thread that watches the worker processes' sentinels."""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing.connection import wait

from diffusion_runtime.executor.mp.group import WorkerGroup
from diffusion_runtime.executor.mp.wakeup import WaitingThread

logger = logging.getLogger(__name__)


class DeathMonitor(WaitingThread):
    """Reports the first worker death to ``on_death`` and stops the other workers.

    A process sentinel becomes readable the moment its process exits, however
    it exits (crash, ``SIGKILL``, the OOM killer), so detection costs no
    polling. The monitor also stops the group when the executor fails for
    another reason (:meth:`stop_workers`), so that never blocks the thread
    that noticed the failure. Closing it means deaths from now on are expected.
    """

    def __init__(self, group: WorkerGroup, on_death: Callable[[str], None], grace: float) -> None:
        super().__init__("diffusion-mp-monitor")
        self._group = group
        self._on_death = on_death
        self._grace = grace

    def stop_workers(self) -> None:
        """Stop the workers from the monitor thread (the executor has failed)."""
        self._wakeup.set()

    def _run(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._group.processes)}
        ready = wait([self._wakeup.fileno(), *sentinels])
        if self._closing:
            return
        dead = sorted(sentinels[fd] for fd in ready if isinstance(fd, int) and fd in sentinels)
        if dead:
            reason = "; ".join(self._group.describe_exit(rank) for rank in dead)
            logger.error("worker process died: %s", reason)
            self._on_death(reason)
        self._group.stop(self._grace)
