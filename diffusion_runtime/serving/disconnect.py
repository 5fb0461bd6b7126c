"""Noticing that the HTTP client went away, so its request can be aborted."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, result: asyncio.Future[T]) -> T:
    """``result``'s value; :class:`ClientDisconnected` if the client disconnects first.

    One watcher task per exchange and nothing else: this runs for every
    request, on the event loop that also serves every other client.
    """
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((watcher, result), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if result.done():
        return result.result()
    watcher.result()  # its own error, if receiving failed
    raise ClientDisconnected
