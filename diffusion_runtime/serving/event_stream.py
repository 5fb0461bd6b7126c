"""A server-sent events response that always runs its cleanup."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from diffusion_runtime.serving.disconnect import wait_for_disconnect

#: A comment line: clients ignore it, proxies see the connection is alive.
KEEPALIVE = b": keep-alive\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as JSON (OpenAI's stream format)."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(Response):
    """Streams the chunks of ``events`` as ``text/event-stream``.

    ``on_close`` runs once the response ends, however it ends: finished,
    client disconnected (noticed at once, not at the next send) or failed.
    Owning the cleanup here means it runs even if the event iterator never
    started.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        # No body: ``init_headers`` then sets no Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for chunk in self._events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()
        finally:
            self._on_close()
