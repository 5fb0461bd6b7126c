"""Handing a pipeline its share of the ranks that share one model (``docs/parallelism.md``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import CollectiveFault, InvalidFieldError
from diffusion_runtime.pipelines.parallel import ParallelContext

_RULES = {
    "cfg_parallel_size": "must be 1 for {name}: it declares no guidance branches to split "
    "(parallel_degrees); the digits pipeline and the diffusers DiT and Stable Diffusion "
    "families take it",
    "ulysses_degree": "must be 1 for {name}: sequence parallelism needs a pipeline that "
    "declares it in parallel_degrees, and no built-in pipeline does yet",
    "ring_degree": "must be 1 for {name}: sequence parallelism needs a pipeline that "
    "declares it in parallel_degrees, and no built-in pipeline does yet",
}


def check_parallel_degrees(pipeline: Any, config: EngineConfig) -> None:
    """Refuse, by field, a degree above 1 that ``pipeline`` does not declare it takes."""
    taken: frozenset[str] = getattr(pipeline, "parallel_degrees", frozenset())
    name = type(pipeline).__name__
    for degree, rule in _RULES.items():
        value = getattr(config, degree)
        if value > 1 and degree not in taken:
            raise InvalidFieldError("EngineConfig", degree, rule.format(name=name), value)


def enable_parallel(pipeline: Any, config: EngineConfig, rank: int) -> None:
    """Check the degrees and give ``pipeline`` this rank's :class:`ParallelContext`.

    Nothing happens with every degree at 1: a pipeline then never sees a context.
    """
    if config.world_size == 1:
        return
    check_parallel_degrees(pipeline, config)
    if not dist.is_initialized():
        raise RuntimeError(
            "a parallel degree above 1 needs the workers in a torch.distributed group; "
            "the executor did not create one"
        )
    # The sequence degrees are 1 here (checked above), so the CFG split spans the world.
    pipeline.enable_parallel(ParallelContext(rank, config.cfg_parallel_size, _all_gather))


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor``; a failed gather fails the executor, not the requests
    of the step (a broken group cannot serve the next one either)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(parts, tensor.contiguous())
    except RuntimeError as exc:
        raise CollectiveFault(f"a gather between ranks failed: {exc}") from exc
    return parts
