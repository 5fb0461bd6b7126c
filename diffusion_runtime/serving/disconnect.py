"""Noticing that the HTTP client went away, so its request can be aborted."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Await ``work()``; if the client disconnects first, cancel it and raise
    :class:`ClientDisconnected`."""
    finished: list[T] = []
    failed: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await wait_for_disconnect(receive)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:  # raised here, not from the group, so it is not wrapped in an ExceptionGroup
            finished.append(await work())
        except Exception as exc:
            failed.append(exc)
        group.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if not finished:
        raise ClientDisconnected
    return finished[0]
