"""The Ray actor hosting one replica's engine (an async actor: one event loop serves all calls)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine, EngineSnapshot
from diffusion_runtime.executor.mp.remote_error import RemoteError
from diffusion_runtime.executor.ray.failures import WorkerMethodError
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams


class EngineReplica:
    """One engine, driven through its public API only.

    ``load`` (requests admitted and not yet finished, i.e. waiting plus
    running) is counted here, so a heartbeat never waits for the engine's loop.
    Errors raised to the front are wrapped so that their type survives Ray.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._engine = DiffusionEngine.make_engine(config)
        self._in_flight: set[str] = set()

    async def load(self) -> int:
        self._engine.check_health()
        return len(self._in_flight)

    async def add_request(self, prompt: Any, params: SamplingParams, request_id: str) -> str:
        try:
            await self._engine.add_request(prompt, params, request_id)
        except Exception as exc:
            raise WorkerMethodError(RemoteError.capture(exc, 0)) from None
        self._in_flight.add(request_id)
        return request_id

    async def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs (a Ray streaming generator on the front's side)."""
        try:
            async for output in self._engine.stream(request_id):
                yield output
        except Exception as exc:
            raise WorkerMethodError(RemoteError.capture(exc, 0)) from None
        finally:
            self._in_flight.discard(request_id)

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> RequestOutput:
        await self.add_request(prompt, params, request_id)
        final: RequestOutput | None = None
        async for output in self.stream(request_id):
            final = output
        assert final is not None and final.finished
        return final

    async def abort(self, request_ids: Iterable[str], reason: str) -> None:
        self._engine.abort(list(request_ids), reason)

    async def snapshot(self) -> EngineSnapshot:
        return await asyncio.to_thread(self._engine.snapshot)

    async def close(self) -> None:
        await asyncio.to_thread(self._engine.close)
