"""Pipelines by name: the built-in ones and those users register."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch

PipelineFactory = Callable[..., Any]

#: Built-in pipelines, as import paths so that naming one never imports the others.
BUILTIN_PIPELINES: dict[str, str] = {
    "digits": "diffusion_runtime.pipelines.digits:DigitsPipeline",
    "diffusers": "diffusion_runtime.pipelines.diffusers:from_pretrained_dir",
}

#: Installed packages name their pipelines in this entry-point group (``name = "module:attr"``);
#: every process, worker processes included, finds them by name without registering anything.
ENTRY_POINT_GROUP = "diffusion_runtime.pipelines"


@functools.cache
def declared_pipelines() -> dict[str, str]:
    """Built-in pipelines and those installed packages declare, by name, as import paths."""
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    declared = {ep.name: ep.value for ep in entry_points}
    return {**declared, **BUILTIN_PIPELINES}


_registered: dict[str, PipelineFactory] = {}


def register_pipeline(name: str, factory: PipelineFactory, *, replace: bool = False) -> None:
    """Make ``EngineConfig(pipeline=name)`` build pipelines with ``factory``.

    Registration is per process: with worker processes, prefer an import path.
    Registering a taken name raises unless ``replace=True``.
    """
    if name in declared_pipelines():
        raise ValueError(f"pipeline name {name!r} is taken by a built-in or installed pipeline")
    if name in _registered and not replace:
        raise ValueError(f"pipeline name {name!r} is already registered; pass replace=True")
    _registered[name] = factory


def is_known_pipeline_name(name: str) -> bool:
    """A registered or built-in name, or something shaped like an import path."""
    return name in _registered or name in declared_pipelines() or ":" in name or "." in name


def import_object(path: str) -> Any:
    """Import ``"package.module:attr"`` (or ``"package.module.attr"``)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_pipeline_factory(spec: str | PipelineFactory) -> PipelineFactory:
    if callable(spec):
        return spec
    if spec in _registered:
        return _registered[spec]
    declared = declared_pipelines()
    if spec in declared:
        factory: PipelineFactory = import_object(declared[spec])
        return factory
    if ":" in spec or "." in spec:
        factory = import_object(spec)
        return factory
    known = sorted({*declared, *_registered})
    raise ValueError(f"unknown pipeline {spec!r}; known pipelines: {', '.join(known)}")


def build_pipeline(
    spec: str | PipelineFactory, device: torch.device, kwargs: dict[str, Any]
) -> Any:
    """Construct the pipeline ``spec`` names, on ``device``."""
    return resolve_pipeline_factory(spec)(device=device, **kwargs)
