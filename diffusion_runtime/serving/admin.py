"""Operator routes behind ``ServerConfig(admin_routes=True)``: sleep, wake, profile.

Off by default: whoever reaches the port could otherwise take the model off
the device. The calls wait for the engine's current step, so they run on a
worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import (
    DiffusionRuntimeError,
    PipelineContractError,
    ProfilingError,
    SleepStateError,
)
from diffusion_runtime.serving.errors import APIError, engine_error

#: Refusals an operator can fix by asking differently (400) or later (409).
_CONFLICTS = (SleepStateError,)
_BAD_REQUESTS = (PipelineContractError, ProfilingError, ValueError)


def add_admin_routes(app: FastAPI, engine: DiffusionEngine, retry_after_s: int) -> None:
    """``POST /admin/sleep?level=1|2``, ``POST /admin/wake_up``, ``GET /admin/sleeping``,
    ``POST /admin/start_profile?prefix=...``, ``POST /admin/stop_profile``."""

    async def call(fn: Callable[..., object], *args: object) -> object:
        try:
            return await asyncio.to_thread(fn, *args)
        except _CONFLICTS as exc:
            raise APIError(409, str(exc), code="conflict") from None
        except _BAD_REQUESTS as exc:
            raise APIError(400, str(exc), code="refused") from None
        except DiffusionRuntimeError as exc:
            raise engine_error(exc, retry_after_s) from None

    @app.post("/admin/sleep")
    async def sleep(level: int = 1) -> JSONResponse:
        """Free the device after the current step; requests wait until a wake."""
        await call(engine.sleep, level)
        return JSONResponse({"sleeping": True, "level": level})

    @app.post("/admin/wake_up")
    async def wake_up() -> JSONResponse:
        """Restore the weights and serve again."""
        await call(engine.wake_up)
        return JSONResponse({"sleeping": False})

    @app.get("/admin/sleeping")
    async def sleeping() -> JSONResponse:
        return JSONResponse({"sleeping": engine.is_sleeping, "state": engine.state.value})

    @app.post("/admin/start_profile")
    async def start_profile(prefix: str | None = None) -> JSONResponse:
        """Profile every worker into the engine's ``profile_dir``; the trace paths."""
        return JSONResponse({"traces": await call(engine.start_profile, prefix)})

    @app.post("/admin/stop_profile")
    async def stop_profile() -> JSONResponse:
        """Stop profiling and write the traces; their paths."""
        return JSONResponse({"traces": await call(engine.stop_profile)})
