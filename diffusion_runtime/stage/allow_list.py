"""Which worker methods a client may call through the stage."""

from __future__ import annotations

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.pipelines.registry import import_object
from diffusion_runtime.runner.worker import Worker, extension_method_names


def rpc_allow_list(config: EngineConfig) -> frozenset[str]:
    """The worker's own control methods and the public methods of the configured
    worker extensions, by the rule the worker uses to register them; never the
    methods that run or drop scheduler decisions, or put the workers to sleep."""
    methods = set(Worker.RPC_METHODS - Worker.RESERVED_METHODS)
    for extension in config.worker_extensions:
        cls = import_object(extension) if isinstance(extension, str) else extension
        methods.update(extension_method_names(cls))
    return frozenset(methods - Worker.RESERVED_METHODS)
