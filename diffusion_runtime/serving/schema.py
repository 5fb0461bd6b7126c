"""The OpenAI images API's request and response bodies, plus this server's extensions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's fields, then this server's extensions.

    Fields this server does not know are refused (400 naming the field), so a
    request never runs with part of it silently dropped.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None
    user: str | None = None
    stream: bool | None = None
    # Extensions.
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    priority: int | None = None
    deadline: float | None = None


class ImageData(BaseModel):
    """One generated image: inline PNG (``b64_json``) or a link the server serves (``url``)."""

    b64_json: str | None = None
    url: str | None = None


class ImagesResponse(BaseModel):
    """The OpenAI images response; ``seed`` (an extension) reproduces the request."""

    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    size: str
    seed: int


class ModelCard(BaseModel):
    """A served model; an adapter's card names the base model (``parent``) and its
    adapter file (``root``), as vLLM's do."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffusion-runtime"
    parent: str | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object."""

    error: ErrorDetail
