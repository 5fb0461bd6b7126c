"""Bugs in the ranks that share one model: CFG-parallel digits over mp workers.

Worker processes are spawned, so a patch in this process never reaches them:
:func:`workers_planting` makes the mp workers started while it is open load a
worker extension that plants the bug in each worker before it serves. The
``cfg-parallel`` target's direct oracle runs the pipeline in this process with
every degree at 1, so a split that changes one bit of an image fails there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.executor.mp import executor as mp_executor
from diffusion_runtime.pipelines.parallel import ParallelContext
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute

RunRows = Callable[
    [ParallelContext, Sequence[int], Callable[[list[int]], torch.Tensor]], torch.Tensor
]


def workers_planting(extension: str) -> Patch:
    """mp workers started while the context is open also load ``extension`` (an
    import path), whose construction plants a bug in that worker process."""

    def make(original: Callable[[EngineConfig], EngineConfig]) -> Any:
        def planted(config: EngineConfig) -> EngineConfig:
            config = original(config)
            return attrs.evolve(config, worker_extensions=(*config.worker_extensions, extension))

        return planted

    return replace_attribute(mp_executor, "worker_config", make)


def _replace_run_rows(make: Callable[[RunRows], RunRows]) -> None:
    """In this worker process, for good: it ends with the worker."""
    ParallelContext.run_rows = make(ParallelContext.run_rows)  # type: ignore[method-assign,assignment]


class SwapGatheredBranches:
    """Plants: every rank puts the gathered parts back in reverse rank order."""

    def __init__(self, worker: Any) -> None:
        def make(original: RunRows) -> RunRows:
            def run_rows(
                self: ParallelContext,
                owners: Sequence[int],
                compute: Callable[[list[int]], torch.Tensor],
            ) -> torch.Tensor:
                swapped = attrs.evolve(self, gather=lambda part: self.gather(part)[::-1])
                return original(swapped, owners, compute)

            return run_rows

        _replace_run_rows(make)


class ReuseGatheredNoise:
    """Plants: a rank keeps the gathered noise of a batch plan and steps with it
    again whenever the same plan comes back ("the split did not change")."""

    def __init__(self, worker: Any) -> None:
        kept: dict[tuple[int, ...], torch.Tensor] = {}

        def make(original: RunRows) -> RunRows:
            def run_rows(
                self: ParallelContext,
                owners: Sequence[int],
                compute: Callable[[list[int]], torch.Tensor],
            ) -> torch.Tensor:
                plan = tuple(owners)
                if plan not in kept:
                    kept[plan] = original(self, owners, compute)
                return kept[plan]

            return run_rows

        _replace_run_rows(make)


def branches_swapped() -> Patch:
    return workers_planting(f"{__name__}:SwapGatheredBranches")


def stale_gathered_noise() -> Patch:
    return workers_planting(f"{__name__}:ReuseGatheredNoise")


PARALLEL_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="cfg-branches-swapped", mode="step", target="cfg-parallel",
             bug="the gathered guidance branches are put back swapped between ranks",
             patch=branches_swapped),
    Mutation(name="cfg-stale-gathered-noise", mode="request", target="cfg-parallel",
             bug="a rank steps with the noise it gathered for an earlier step",
             patch=stale_gathered_noise),
)  # fmt: skip
