"""What a worker process is started with, and the check that it can be rebuilt there.

Worker processes are spawned, so everything in their :class:`WorkerSpec` is
pickled and rebuilt by import in a fresh interpreter: the pipeline must be a
built-in or registered name, an import path, or a module-level factory or
class; worker extensions must be classes or import paths. A lambda or a local
function is refused here, in the engine process, with the field it came from.
"""

from __future__ import annotations

import pickle
from typing import Any

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.registry import declared_pipelines, resolve_pipeline_factory


@attrs.frozen
class WorkerSpec:
    """One worker process's start-up arguments.

    ``segment_prefix`` names the output segments it may create;
    ``dist_init_method`` is the ``torch.distributed`` rendezvous, or None.
    """

    config: EngineConfig
    rank: int
    segment_prefix: str
    dist_init_method: str | None


def portable_config(config: EngineConfig) -> EngineConfig:
    """``config`` as worker processes will receive it.

    A pipeline registered by name with :func:`register_pipeline` exists only in
    this process, so its factory is sent in its place.
    """
    pipeline = config.pipeline
    if isinstance(pipeline, str) and not _importable_name(pipeline):
        pipeline = resolve_pipeline_factory(pipeline)  # raises for an unknown name
    _require_picklable(
        pipeline,
        "pipeline",
        "must be a registered name, an import path or a module-level factory "
        "for worker processes to build it",
    )
    for extension in config.worker_extensions:
        _require_picklable(
            extension,
            "worker_extensions",
            "must hold module-level classes or import paths for worker processes to load them",
        )
    _require_picklable(
        config.pipeline_kwargs, "pipeline_kwargs", "must be picklable to reach worker processes"
    )
    _require_picklable(
        config.scheduling_policy,
        "scheduling_policy",
        "must be a policy name, an import path or a module-level class to reach another process",
    )
    return config if pipeline is config.pipeline else attrs.evolve(config, pipeline=pipeline)


def worker_config(config: EngineConfig) -> EngineConfig:
    """``config`` as worker processes receive it: portable, and without a policy
    class (workers never schedule, and a class defined in a function cannot travel)."""
    if not isinstance(config.scheduling_policy, str):
        config = attrs.evolve(config, scheduling_policy="fifo")
    return portable_config(config)


def _importable_name(name: str) -> bool:
    return name in declared_pipelines() or ":" in name or "." in name


def _require_picklable(value: Any, field: str, rule: str) -> None:
    try:
        pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidFieldError("EngineConfig", field, rule, value) from exc
