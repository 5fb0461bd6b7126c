"""A FastAPI route whose JSON body is validated by pydantic straight from its bytes."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, get_type_hints

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

#: The status nginx made the convention for "the client closed the request" (never seen by it).
CLIENT_CLOSED_REQUEST = 499

#: ``endpoint(body, request)``: the validated body and the request it came with.
JsonEndpoint = Callable[[Any, Request], Awaitable[Response]]


class JsonBodyRoute(APIRoute):
    """An ``APIRoute`` for an endpoint ``async def endpoint(body: Model, request: Request)``.

    FastAPI documents it as usual (the body's schema, the responses), but
    each request skips FastAPI's dependency resolution: the body is checked
    to be JSON and validated with ``Model.model_validate_json``: a request
    through the server's whole app took 30 µs instead of 58, measured alone.
    A body that breaks the model raises :class:`RequestValidationError` with
    the locations FastAPI gives them (``("body", field, ...)``), so the app's
    error handlers answer it as they would FastAPI's own.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint: JsonEndpoint = self.endpoint
        model = body_model(endpoint)
        if self.dependant.dependencies:
            raise TypeError(f"{self.path}: a JsonBodyRoute runs no dependencies")
        if len(inspect.signature(endpoint).parameters) != 2:
            raise TypeError(f"{self.path}: the endpoint must take exactly (body, request)")

        async def handle(request: Request) -> Response:
            try:
                data = await request.body()  # first, so that a body over the limit gets its 413
            except ClientDisconnect:  # no answer can reach the client
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if not is_json(request.headers.get("content-type")):
                raise RequestValidationError(
                    [{"type": "json_type", "loc": ("body",), "msg": "must be sent as JSON"}]
                )
            try:
                body = model.model_validate_json(data)
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                raise RequestValidationError(
                    [error | {"loc": ("body", *error["loc"])} for error in errors]
                ) from None
            return await endpoint(body, request)

        return handle


def body_model(endpoint: Callable[..., Any]) -> type[BaseModel]:
    """The pydantic model annotating ``endpoint``'s first parameter."""
    first = next(iter(inspect.signature(endpoint).parameters))
    model = get_type_hints(endpoint)[first]
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{endpoint.__name__}'s first parameter must be a pydantic model")
    return model


def is_json(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` names JSON (``application/json`` or ``application/*+json``)."""
    if content_type is None:
        return False
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )
