"""The ASGI app: OpenAI's images API, models, health, version and metrics over one engine."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import DiffusionRuntimeError
from diffusion_runtime.serving.adapters import ServedAdapters, add_adapter_routes
from diffusion_runtime.serving.admin import add_admin_routes
from diffusion_runtime.serving.body_limit import BodySizeLimit
from diffusion_runtime.serving.config import ServerConfig
from diffusion_runtime.serving.errors import APIError, engine_error, install_error_handlers
from diffusion_runtime.serving.generation import ImageGeneration
from diffusion_runtime.serving.http_metrics import HttpMetrics, ResponseCounter
from diffusion_runtime.serving.json_body_route import JsonBodyRoute
from diffusion_runtime.serving.metrics import EngineMetrics
from diffusion_runtime.serving.schema import (
    ErrorResponse,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
)

ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 413, 429, 500, 503)
}


def served_model_name(engine: DiffusionEngine, config: ServerConfig) -> str:
    """``config.model_name``, else the engine's pipeline name (``"default"`` for a factory)."""
    if config.model_name is not None:
        return config.model_name
    pipeline = engine.config.pipeline
    return pipeline if isinstance(pipeline, str) else "default"


def package_version() -> str:
    try:
        return importlib.metadata.version("diffusion-runtime")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_app(
    engine: DiffusionEngine,
    config: ServerConfig | None = None,
    *,
    metrics: EngineMetrics | None = None,
) -> FastAPI:
    """An ASGI app serving ``engine`` with OpenAI's images API.

    The caller owns the engine and closes it after the server stops. While the
    app runs (between its lifespan's start and end) it counts the engine's
    events into ``metrics`` (a fresh :class:`EngineMetrics` by default;
    ``app.state.metrics.registry`` is its registry, also served at
    ``/metrics``). At shutdown it aborts the streams still open; a plain
    request's handler, cancelled by the server when its grace ends, aborts its own.
    """
    config = config if config is not None else ServerConfig()
    metrics = metrics if metrics is not None else EngineMetrics(engine)
    http_metrics = HttpMetrics(metrics.registry)
    if config.lora_updates and not engine.config.max_loras:
        raise ValueError("ServerConfig.lora_updates needs EngineConfig.max_loras > 0")
    model_name = served_model_name(engine, config)
    models = ServedAdapters(engine, model_name)
    generation = ImageGeneration(engine, config, models, metrics, http_metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.attach()
        try:
            yield
        finally:
            await generation.readers.aclose()
            metrics.detach()

    version = package_version()
    app = FastAPI(
        title="diffusion-runtime",
        version=version,
        lifespan=lifespan,
        # FastAPI's OpenTelemetry looks for configured providers on every request,
        # reading the environment each time: 18 % of the event loop's time under load.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.metrics = metrics
    app.state.generation = generation
    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=config.max_body_bytes,
        on_refused=http_metrics.refused.labels("body_too_large").inc,
    )
    app.add_middleware(ResponseCounter, metrics=http_metrics)

    async def create_images(body: ImageGenerationRequest, request: Request) -> Response:
        """Generate images (OpenAI's schema plus extensions; ``stream`` for progress events)."""
        return await generation.handle(body, request)

    # The hot path: its body is validated without FastAPI's dependency resolution.
    app.router.add_api_route(
        "/v1/images/generations",
        create_images,
        methods=["POST"],
        response_model=ImagesResponse,
        responses=ERROR_RESPONSES,
        route_class_override=JsonBodyRoute,
    )

    @app.get("/v1/images/files/{name}.png", name="image_file", responses=ERROR_RESPONSES)
    async def image_file(name: str) -> Response:
        """An image made with ``response_format="url"``, while it is kept."""
        png = generation.store.get(name)
        if png is None:
            raise APIError(404, f"no image {name!r} (it may have expired)", code="not_found")
        return Response(png, media_type="image/png")

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, created=created)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> JSONResponse:
        """The base model, then each adapter the server serves as a model of its own."""
        return JSONResponse(ModelList(data=[model_card(), *models.cards()]).model_dump())

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def get_model(model: str) -> JSONResponse:
        card = model_card() if model == model_name else models.card(model)  # 404 if not served
        return JSONResponse(card.model_dump())

    @app.get("/health", responses=ERROR_RESPONSES)
    async def health() -> JSONResponse:
        """200 while the engine serves; 503 once it is closed or dead."""
        try:
            engine.check_health()
        except DiffusionRuntimeError as exc:
            raise engine_error(exc, config.retry_after_s) from None
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """Prometheus text format; see docs/serving.md for every metric."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.admin_routes:
        add_admin_routes(app, engine, config.retry_after_s)
    if config.lora_updates:
        add_adapter_routes(app, models, config.retry_after_s, time.time)
    return app
