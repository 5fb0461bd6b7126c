"""The result pump: one thread that reads every worker's result pipe."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from diffusion_runtime.executor.mp.messages import FromWorker, loads
from diffusion_runtime.executor.mp.wakeup import WaitingThread

logger = logging.getLogger(__name__)


class ResultPump(WaitingThread):
    """Decodes each message from the workers and hands it to ``deliver``.

    ``deliver`` returns False once nobody is left to deliver to. A worker's
    pipe that reaches end-of-file is dropped: the death monitor reports the
    death, the pump only stops listening.
    """

    def __init__(
        self, connections: Sequence[Connection], deliver: Callable[[FromWorker], bool]
    ) -> None:
        super().__init__("diffusion-mp-results")
        self._connections = list(connections)
        self._deliver = deliver

    def _run(self) -> None:
        wakeup = self._wakeup.fileno()
        open_connections = list(self._connections)
        while open_connections and not self._closing:
            for ready in wait([wakeup, *open_connections]):
                if not isinstance(ready, Connection) or self._closing:
                    return
                try:
                    data = ready.recv_bytes()
                except (EOFError, OSError):
                    open_connections.remove(ready)
                    continue
                try:
                    message = loads(data)
                except Exception:
                    logger.exception("dropped a worker message that could not be decoded")
                    continue
                if not self._deliver(message):
                    return
