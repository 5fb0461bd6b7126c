"""The server's own metrics: HTTP answers by route and status, refusals, disconnects."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMetrics:
    """Counters of the HTTP front, in the same registry as the engine's metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.responses = Counter(
            "diffusion_http_responses",
            "HTTP responses by route and status code",
            ["route", "code"],
            registry=registry,
        )
        self.refused = Counter(
            "diffusion_http_refused",
            "Image requests refused before admission, by reason "
            "(queue_full, client_limit, body_too_large)",
            ["reason"],
            registry=registry,
        )
        for reason in ("queue_full", "client_limit", "body_too_large"):
            self.refused.labels(reason)
        self.disconnects = Counter(
            "diffusion_http_client_disconnects",
            "Image requests whose client left before the answer; each was aborted",
            registry=registry,
        )


class ResponseCounter:
    """ASGI middleware counting responses by route template (never the raw path,
    which would make unbounded label values) and status code."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            code = str(status[0]) if status else "500"
            self.metrics.responses.labels(path, code).inc()
