"""A lean HTTP/1.1 load generator for ``bench http``: keep-alive connections on asyncio
streams, answers parsed by ``httptools`` (the C parser uvicorn itself uses).

On a machine with few cores the load generator shares them with the server
it measures, so every millisecond of client CPU shows up as server latency.
``httpx`` spends about 1.1 ms of CPU per request here; this client spends a
small fraction of that, so what the benchmark reports is the server's cost.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httptools


class _Answer:
    """httptools' callbacks for one response: its body, and when it is complete."""

    def __init__(self, complete: asyncio.Future[None]) -> None:
        self.body: list[bytes] = []
        self._complete = complete

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self._complete.set_result(None)


class LeanConnection:
    """One keep-alive connection that sends one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, url: str) -> LeanConnection:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"url {url!r} needs a host and a port")
        return cls(*await asyncio.open_connection(parts.hostname, parts.port))

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``path``; return the status code and the answer's body."""
        self._writer.write(
            b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        complete: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answer = _Answer(complete)
        parser = httptools.HttpResponseParser(answer)
        while not complete.done():
            data = await self._reader.read(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection mid-answer")
            parser.feed_data(data)
        return parser.get_status_code(), b"".join(answer.body)

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
