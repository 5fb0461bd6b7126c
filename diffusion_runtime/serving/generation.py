"""``POST /v1/images/generations``: admit, wait (or stream), answer; abort on disconnect."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
import attrs
from fastapi import Request
from starlette.responses import Response

from diffusion_runtime.errors import DiffusionRuntimeError, QueueFullError
from diffusion_runtime.front import Front
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.serving.adapters import ServedAdapters
from diffusion_runtime.serving.admission import ClientLimiter
from diffusion_runtime.serving.config import ServerConfig
from diffusion_runtime.serving.disconnect import DisconnectWatch
from diffusion_runtime.serving.errors import APIError, bad_field, engine_error
from diffusion_runtime.serving.event_stream import KEEPALIVE, EventStreamResponse, sse_event
from diffusion_runtime.serving.http_metrics import HttpMetrics
from diffusion_runtime.serving.images import (
    ImageStore,
    b64,
    encodes_inline,
    png_images,
    size_of,
)
from diffusion_runtime.serving.json_body_route import CLIENT_CLOSED_REQUEST
from diffusion_runtime.serving.metrics import EngineMetrics
from diffusion_runtime.serving.params import sampling_params_for
from diffusion_runtime.serving.request_outputs import OutputReaders, RequestOutputs
from diffusion_runtime.serving.schema import ImageData, ImageGenerationRequest, ImagesResponse


class ImageGeneration:
    """Serves image generation requests against one front (any :class:`Front`);
    a request naming an adapter's model runs with that adapter."""

    def __init__(
        self,
        engine: Front,
        config: ServerConfig,
        models: ServedAdapters,
        metrics: EngineMetrics,
        http_metrics: HttpMetrics,
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = models
        self.metrics = metrics
        self.http_metrics = http_metrics
        self.limiter = ClientLimiter(config.per_client_limit, config.retry_after_s)
        self.store = ImageStore(config.max_stored_images, config.image_ttl_s)
        self.readers = OutputReaders()

    async def handle(self, body: ImageGenerationRequest, request: Request) -> Response:
        lora = self.models.lora_for(body.model)
        params = sampling_params_for(body, self.config)
        if lora is not None:
            params = attrs.evolve(params, lora=lora)
        if body.stream and body.response_format == "url":
            raise bad_field(
                "response_format", "response_format: a stream sends its images inline (b64_json)"
            )
        client = body.user or (request.client.host if request.client else "unknown")
        if body.stream:
            return await self._stream(body.prompt, params, client)
        request_id = await self._admit(body.prompt, params, client)
        try:
            final = await self._final_output(request_id, request, client)
        except DiffusionRuntimeError as exc:
            raise engine_error(exc, self.config.retry_after_s) from None
        if final is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await self._answer(final, params, body.response_format or "b64_json", request)

    async def _admit(self, prompt: str, params: SamplingParams, client: str) -> str:
        """Take a slot of ``client``'s and admit the request; its id."""
        try:
            self.limiter.acquire(client)
        except APIError:
            self.http_metrics.refused.labels("client_limit").inc()
            raise
        try:
            return await self.engine.add_request(prompt, params)
        except DiffusionRuntimeError as exc:
            self.limiter.release(client)
            if isinstance(exc, QueueFullError):
                self.http_metrics.refused.labels("queue_full").inc()
            raise engine_error(exc, self.config.retry_after_s) from None
        except BaseException:
            self.limiter.release(client)
            raise

    async def _final_output(
        self, request_id: str, request: Request, client: str
    ) -> RequestOutput | None:
        """The request's final output, read on the handler's own task; ``None`` if the
        client disconnected first. ``client``'s slot is given back once: when the
        client leaves (its request is then aborted, and a retry need not wait for
        the abort to take effect) or when the output has been read."""
        release = self.limiter.releaser(client)
        final: RequestOutput | None = None

        def abandon() -> None:
            release()
            if final is None or not final.finished:
                self.http_metrics.disconnects.inc()
                self.engine.abort(request_id, "the HTTP client disconnected")

        watch = DisconnectWatch(request.receive, abandon)
        try:
            async for output in self.engine.stream(request_id):
                final = output
        finally:
            watch.close()
            release()
        return None if watch.disconnected else final

    async def _stream(self, prompt: str, params: SamplingParams, client: str) -> Response:
        """Admit a streaming request and answer with its events."""
        request_id = await self._admit(prompt, params, client)
        outputs = RequestOutputs(self.engine, request_id, self.readers)

        def end() -> None:
            """The stream is over: free the client's slot; abort the request if it still runs."""
            self.limiter.release(client)
            if not outputs.finished:
                self.http_metrics.disconnects.inc()
                outputs.abandon("the HTTP client disconnected")

        return EventStreamResponse(self._events(outputs, params), on_close=end)

    def _accept_final(self, final: RequestOutput, params: SamplingParams) -> None:
        """Count a completed request's steps; raise the API's error for any other ending."""
        if final.ok:
            if final.num_steps is None:  # request mode: the engine reported no steps
                self.metrics.count_steps(params.num_inference_steps)
            return
        if final.status is RequestStatus.FINISHED_ABORTED:
            raise APIError(
                503,
                f"the request was aborted: {final.error}",
                error_type="server_error",
                code="aborted",
            )
        raise APIError(
            500,
            f"the generation failed: {final.error}",
            error_type="server_error",
            code="generation_failed",
        )

    async def _answer(
        self, final: RequestOutput, params: SamplingParams, response_format: str, request: Request
    ) -> Response:
        self._accept_final(final, params)
        pngs = await encode(final)
        if response_format == "url":
            data = [
                ImageData(url=str(request.url_for("image_file", name=self.store.put(png))))
                for png in pngs
            ]
        else:
            data = [ImageData(b64_json=b64(png)) for png in pngs]
        response = ImagesResponse(
            created=int(time.time()), data=data, size=size_of(final.image_batch), seed=final.seed
        )
        return Response(response.model_dump_json(exclude_none=True), media_type="application/json")

    async def _events(
        self, outputs: RequestOutputs, params: SamplingParams
    ) -> AsyncIterator[bytes]:
        """OpenAI's image stream events, plus ``image_generation.progress`` per step."""
        partial_index = 0
        while True:
            try:
                output = await outputs.next(self.config.stream_keepalive_s)
            except DiffusionRuntimeError as exc:
                yield sse_event(_error_event(engine_error(exc, self.config.retry_after_s)))
                return
            if output is None:
                yield KEEPALIVE
                continue
            if not output.finished:
                yield sse_event(_progress_event(output))
                if output.image_batch is not None:
                    for png in await encode(output):
                        yield sse_event(
                            _image_event("image_generation.partial_image", output, png)
                            | {"partial_image_index": partial_index}
                        )
                        partial_index += 1
                continue
            try:
                self._accept_final(output, params)
            except APIError as error:
                yield sse_event(_error_event(error))
                return
            for index, png in enumerate(await encode(output)):
                yield sse_event(
                    _image_event("image_generation.completed", output, png)
                    | {"image_index": index, "seed": output.seed}
                )
            return


async def encode(output: RequestOutput) -> list[bytes]:
    """``output``'s images as PNGs; large ones on a worker thread, so the loop keeps serving."""
    if encodes_inline(output):
        return png_images(output)
    return await anyio.to_thread.run_sync(png_images, output)


def _progress_event(output: RequestOutput) -> dict[str, Any]:
    return {
        "type": "image_generation.progress",
        "created_at": int(time.time()),
        "step": output.step,
        "num_steps": output.num_steps,
    }


def _image_event(kind: str, output: RequestOutput, png: bytes) -> dict[str, Any]:
    return {
        "type": kind,
        "b64_json": b64(png),
        "created_at": int(time.time()),
        "size": size_of(output.image_batch),
        "output_format": "png",
        "background": "opaque",
        "quality": "auto",
    }


def _error_event(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": error.detail.model_dump()}
