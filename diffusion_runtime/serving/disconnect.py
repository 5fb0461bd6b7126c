"""Noticing that the HTTP client went away, so its request can be aborted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import Receive


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Calls ``on_disconnect`` once if the client disconnects before :meth:`close`.

    One watcher task per exchange and nothing else: this runs for every
    request, on the event loop that also serves every other client. The
    handler reads its result meanwhile; ``on_disconnect`` (an abort) makes
    that result come early.
    """

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        #: Whether the client left (or receiving from it failed) before :meth:`close`.
        self.disconnected = False
        self._closed = False
        self._on_disconnect = on_disconnect
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        try:
            await wait_for_disconnect(receive)
        finally:
            if not self._closed:  # no answer can reach the client now
                self.disconnected = True
                self._on_disconnect()

    def close(self) -> None:
        """Stop watching; raise the watcher's own error if receiving failed."""
        self._closed = True
        if not self._watcher.done():
            self._watcher.cancel()
        elif not self._watcher.cancelled():
            self._watcher.result()
