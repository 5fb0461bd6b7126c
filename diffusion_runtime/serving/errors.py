"""Every failure as OpenAI's error object, with the right status and never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from diffusion_runtime.errors import (
    DiffusionRuntimeError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    QueueFullError,
)
from diffusion_runtime.serving.schema import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

#: Engine and ``SamplingParams`` field names as the API's clients know them.
PUBLIC_FIELD_NAMES = {
    "height": "size",
    "width": "size",
    "num_outputs_per_prompt": "n",
    "deadline_s": "deadline",
}


HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


class APIError(Exception):
    """A refusal to send as an OpenAI error object with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=error_type, param=param, code=code)
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.detail).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_field(param: str, message: str) -> APIError:
    """A 400 naming the request field at fault."""
    return APIError(400, message, param=param, code="invalid_value")


def too_many_requests(message: str, code: str, retry_after_s: int) -> APIError:
    return APIError(
        429,
        message,
        error_type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_error(exc: DiffusionRuntimeError, retry_after_s: int) -> APIError:
    """The API's answer to an error the engine raised."""
    if isinstance(exc, InvalidFieldError):
        param = PUBLIC_FIELD_NAMES.get(exc.field, exc.field)
        return bad_field(param, f"{param}: {exc.rule}; got {exc.value!r}")
    if isinstance(exc, QueueFullError):
        return too_many_requests(str(exc), "queue_full", retry_after_s)
    if isinstance(exc, (EngineDeadError, EngineClosedError)):
        return APIError(
            503,
            f"the engine is not serving: {exc}",
            error_type="server_error",
            code="engine_unavailable",
        )
    return internal_error(exc)


def internal_error(exc: BaseException) -> APIError:
    logger.error("request failed inside the server", exc_info=exc)
    return APIError(500, "internal server error", error_type="server_error", code="internal")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure, including FastAPI's own, with OpenAI's error object."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def invalid_body(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        if first.get("type") == "extra_forbidden":
            message = f"{param}: this server does not support this field"
        elif first.get("type") == "json_invalid":
            message = "the body is not valid JSON"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid request body')}"
        return bad_field(param or "body", message).response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        param = "body" if status == 413 else None
        code = HTTP_ERROR_CODES.get(status)
        return APIError(
            status, str(exc.detail), param=param, code=code, headers=exc.headers
        ).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
