"""What a worker process is started with, and the check that it can be rebuilt there.

Worker processes are spawned, so everything in their :class:`WorkerSpec` is
pickled and rebuilt by import in a fresh interpreter: the pipeline must be a
built-in or registered name, an import path, or a module-level factory or
class; worker extensions must be classes or import paths. A lambda or a local
function is refused here, in the engine process, with the field it came from.
"""

from __future__ import annotations

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.executor.portable import require_serialisable, with_portable_pipeline


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
    """``config`` as worker processes will receive it (pickled): a pipeline registered
    by name is sent as its factory, and what cannot be pickled is refused by field."""
    config = with_portable_pipeline(config)
    require_serialisable(
        [
            (
                "pipeline",
                config.pipeline,
                "must be a registered name, an import path or a module-level factory "
                "for worker processes to build it",
            ),
            *(
                (
                    "worker_extensions",
                    extension,
                    "must hold module-level classes or import paths for worker processes "
                    "to load them",
                )
                for extension in config.worker_extensions
            ),
            (
                "pipeline_kwargs",
                config.pipeline_kwargs,
                "must be picklable to reach worker processes",
            ),
            (
                "scheduling_policy",
                config.scheduling_policy,
                "must be a policy name, an import path or a module-level class "
                "to reach another process",
            ),
        ]
    )
    return config


def worker_config(config: EngineConfig) -> EngineConfig:
    """``config`` as worker processes receive it: portable, and without a policy
    class (workers never schedule, and a class defined in a function cannot travel)."""
    if not isinstance(config.scheduling_policy, str):
        config = attrs.evolve(config, scheduling_policy="fifo")
    return portable_config(config)
