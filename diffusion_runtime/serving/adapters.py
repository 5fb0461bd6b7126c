"""LoRA adapters as models of their own: ``/v1/models`` lists them, an images
request naming one runs with it, and (behind ``ServerConfig(lora_updates=True)``)
vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them.

The server keeps each adapter it loaded under its name. The engine may evict
one to make room for another; a request naming it then loads it again on
demand, so it stays served until it is unloaded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import DiffusionRuntimeError, InvalidFieldError, LoRAError
from diffusion_runtime.lora.weights import AdapterFileError
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.serving.errors import APIError, bad_field, engine_error
from diffusion_runtime.serving.json_body_route import JsonBodyRoute
from diffusion_runtime.serving.schema import ModelCard


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``: serve the adapter file ``lora_path`` as
    model ``lora_name``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``: stop serving model ``lora_name``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str


class ServedAdapters:
    """The adapters the server serves, by model name, beside the base model."""

    def __init__(self, engine: DiffusionEngine, base_model: str) -> None:
        self.engine = engine
        self.base_model = base_model
        #: Served adapters by model name, with the time each was loaded. Loads and
        #: unloads (on worker threads, under the lock) replace entries whole, so the
        #: event loop reads it without the lock.
        self._served: dict[str, tuple[LoRARequest, int]] = {}
        self._last_id = 0
        self._lock = threading.Lock()

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request naming ``model`` runs with (``None``: the base
        model); a 404 for a model this server does not serve."""
        if model is None or model == self.base_model:
            return None
        return self._entry(model)[0]

    def card(self, name: str) -> ModelCard:
        """An adapter's card (a 404 if it is not served): its ``parent`` is the base
        model, its ``root`` its file."""
        return self._card(name, *self._entry(name))

    def cards(self) -> list[ModelCard]:
        return [self._card(name, *entry) for name, entry in sorted(list(self._served.items()))]

    def _card(self, name: str, lora: LoRARequest, created: int) -> ModelCard:
        return ModelCard(id=name, created=created, parent=self.base_model, root=lora.path)

    def _entry(self, model: str) -> tuple[LoRARequest, int]:
        entry = self._served.get(model)
        if entry is None:
            served = [self.base_model, *sorted(list(self._served))]
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return entry

    def load(self, name: str, path: str, created: int) -> None:
        """Load ``path`` on every worker and serve it as model ``name`` (blocking)."""
        if not name.strip():
            raise bad_field("lora_name", "lora_name: must be a non-empty name")
        with self._lock:
            if name == self.base_model or name in self._served:
                raise bad_field("lora_name", f"lora_name: the model {name!r} is already served")
            # Never an id used before: a request still queued with an unloaded
            # adapter must not meet another file under its id.
            adapter_id = max([self._last_id, *self.engine.list_loras()]) + 1
            try:
                lora = LoRARequest(name, adapter_id, path)
                self.engine.add_lora(lora)
            except (InvalidFieldError, AdapterFileError) as exc:
                field = "lora_name" if getattr(exc, "field", None) == "name" else "lora_path"
                raise bad_field(field, f"{field}: {exc}") from None
            self._served[name] = (lora, created)
            self._last_id = adapter_id

    def unload(self, name: str) -> None:
        """Unload model ``name`` from every worker and stop serving it (blocking)."""
        with self._lock:
            entry = self._served.get(name)
            if entry is None:
                raise APIError(
                    404,
                    f"the LoRA adapter {name!r} is not loaded",
                    param="lora_name",
                    code="not_found",
                )
            self.engine.remove_lora(entry[0].adapter_id)  # False: the engine had evicted it
            del self._served[name]


def add_adapter_routes(
    app: FastAPI, adapters: ServedAdapters, retry_after_s: int, clock: Callable[[], float]
) -> None:
    """``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's routes
    and bodies; a plain-text success). The calls wait for the engine's current step,
    so they run on a worker thread."""

    async def call(fn: Callable[..., None], *args: object) -> None:
        try:
            await asyncio.to_thread(fn, *args)
        except LoRAError as exc:  # no room, or in use: ask again later
            raise APIError(409, str(exc), code="conflict") from None
        except DiffusionRuntimeError as exc:
            raise engine_error(exc, retry_after_s) from None

    async def load(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        """Load an adapter file and serve it as a model of its own."""
        await call(adapters.load, body.lora_name, body.lora_path, int(clock()))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        """Stop serving an adapter and unload it (409 while requests use it)."""
        await call(adapters.unload, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    for path, endpoint in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", unload)):
        app.router.add_api_route(
            path, endpoint, methods=["POST"], route_class_override=JsonBodyRoute
        )
