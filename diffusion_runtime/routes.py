"""OutputRoutes: where a front sends each request's outputs, and which ids are taken.

Every front (the in-process :class:`~diffusion_runtime.engine.DiffusionEngine`,
the stage's :class:`~diffusion_runtime.stage.StageClient`) keeps the same two
tables: the sink of each admitted request until its final output, and the
``add_request`` streams that no reader has claimed yet. An id is taken while it
is in either, so one duplicate check serves both fronts.
"""

from __future__ import annotations

from collections.abc import Iterable

from diffusion_runtime.errors import DuplicateRequestError
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.streams import AsyncStream, OutputSink, claim_stream


class OutputRoutes:
    """The sink of each active request and the unclaimed streams of one front.

    Not thread-safe: a front whose callers are on several threads calls it
    under its own lock.
    """

    def __init__(self) -> None:
        #: The sink of every admitted request whose final output is not delivered yet.
        self.sinks: dict[str, OutputSink] = {}
        #: Streams of ``add_request`` calls that no reader has claimed yet.
        self.unclaimed: dict[str, AsyncStream] = {}

    def is_taken(self, request_id: str) -> bool:
        return request_id in self.sinks or request_id in self.unclaimed

    def check_free(self, request_ids: Iterable[str]) -> None:
        """Raise :class:`DuplicateRequestError` for the first id that is taken: its
        request is active, or its stream holds outputs nobody has read."""
        for request_id in request_ids:
            if self.is_taken(request_id):
                raise DuplicateRequestError(
                    f"request id {request_id!r} is taken: its request is active "
                    "or its output has not been read yet"
                )

    def open(self, sinks: dict[str, OutputSink], stream: AsyncStream | None = None) -> None:
        """Route each id's outputs to its sink; ``stream`` (one request's) waits to
        be claimed by :meth:`claim`, holding the outputs that come before."""
        self.sinks.update(sinks)
        if stream is not None:
            [request_id] = sinks
            self.unclaimed[request_id] = stream

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the routes of requests that were never admitted."""
        for request_id in request_ids:
            self.sinks.pop(request_id, None)
            self.unclaimed.pop(request_id, None)

    def sink_of(self, request_id: str) -> OutputSink | None:
        return self.sinks.get(request_id)

    def route(self, output: RequestOutput) -> OutputSink | None:
        """The sink ``output`` goes to (``None``: nobody's); a final output frees its id
        (an unclaimed stream keeps it until read)."""
        if output.finished:
            return self.sinks.pop(output.request_id, None)
        return self.sinks.get(output.request_id)

    def claim(self, request_id: str) -> AsyncStream:
        """Take a request's unclaimed stream for its one reader (see :func:`claim_stream`)."""
        return claim_stream(self.unclaimed, request_id)

    def close_all(self) -> list[OutputSink]:
        """Forget every active request; return each distinct sink once (to fail it)."""
        sinks = list({id(sink): sink for sink in self.sinks.values()}.values())
        self.sinks.clear()
        return sinks
