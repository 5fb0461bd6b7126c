"""Engine configs that another process can rebuild: the check shared by every
executor (and the stage) that sends an :class:`EngineConfig` elsewhere.

A pipeline registered by name with ``register_pipeline`` exists only in this
process, so its factory travels in its place; every field sent must survive
the serialiser of the transport, or is refused here, by field, in the
engine's process.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.registry import declared_pipelines, resolve_pipeline_factory

#: Turns a value into bytes the way a transport does (``pickle.dumps``, cloudpickle...).
Serialiser = Callable[[Any], bytes]


def with_portable_pipeline(config: EngineConfig) -> EngineConfig:
    """``config`` with a pipeline registered by name in this process replaced by its
    factory; built-in, declared and importable names are kept (any process resolves them)."""
    pipeline = config.pipeline
    if isinstance(pipeline, str) and not _importable_name(pipeline):
        pipeline = resolve_pipeline_factory(pipeline)  # raises for an unknown name
        return attrs.evolve(config, pipeline=pipeline)
    return config


def require_serialisable(
    fields: Iterable[tuple[str, Any, str]], serialise: Serialiser = pickle.dumps
) -> None:
    """Raise :class:`InvalidFieldError` for the first ``(field, value, rule)`` whose value
    ``serialise`` refuses, with the field's name and the rule it breaks."""
    for field, value, rule in fields:
        try:
            serialise(value)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise InvalidFieldError("EngineConfig", field, rule, value) from exc


def _importable_name(name: str) -> bool:
    return name in declared_pipelines() or ":" in name or "." in name
