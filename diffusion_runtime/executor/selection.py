"""Choosing the executor class from ``EngineConfig.executor_backend``."""

from __future__ import annotations

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.pipelines.registry import import_object


def resolve_executor_class(config: EngineConfig) -> type[DiffusionExecutor]:
    backend = config.resolved_backend
    if backend == "uni":
        from diffusion_runtime.executor.uni import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from diffusion_runtime.executor.mp import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from diffusion_runtime.executor.ray import RayExecutor

        return RayExecutor
    cls = import_object(backend) if isinstance(backend, str) else backend
    if not (isinstance(cls, type) and issubclass(cls, DiffusionExecutor)):
        raise TypeError(
            f"EngineConfig.executor_backend {backend!r} is not a DiffusionExecutor subclass"
        )
    return cls
