"""Request bodies larger than a limit are refused with 413 before they are read in full."""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diffusion_runtime.serving.errors import APIError


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` gets a 413 with OpenAI's error object.

    A declared ``Content-Length`` over the limit is refused before reading; a
    chunked body is counted as it arrives and refused (through the app's error
    handlers) once it outgrows the limit. ``on_refused`` is told each time.
    (FastAPI's own ``max_body_size`` answers a too-long ``Content-Length`` in
    plain text, not with the API's error object.)
    """

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            self.on_refused()
            await APIError(413, self._message(), param="body", code="body_too_large").response()(
                scope, receive, send
            )
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    self.on_refused()
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"
