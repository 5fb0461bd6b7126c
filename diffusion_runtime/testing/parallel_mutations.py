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
from diffusion_runtime.pipelines.parallel import ParallelContext, RowBlock
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute

RunRows = Callable[
    [ParallelContext, Sequence[int], Callable[[list[int]], torch.Tensor]], torch.Tensor
]
RowOwners = Callable[[ParallelContext, Sequence[RowBlock]], list[int]]


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


class CountOwnLoadOnly:
    """Plants: a rank balances blocks without guidance counting only the rows it
    computes itself, so two ranks plan different owners for the same rows."""

    def __init__(self, worker: Any) -> None:
        def row_owners(self: ParallelContext, blocks: Sequence[RowBlock]) -> list[int]:
            loads = [0] * self.cfg_size
            owners: list[int] = []
            for rows, branch in blocks:
                rank = loads.index(min(loads)) if branch is None else branch % self.cfg_size
                if rank == self.cfg_rank:
                    loads[rank] += rows
                owners += [rank] * rows
            return owners

        ParallelContext.row_owners = row_owners  # type: ignore[method-assign]


class ReadPaddingFirst:
    """Plants: each gathered part's rows are read from its end, as if the padding
    that evens the parts out came first (the same rows when the split is even)."""

    def __init__(self, worker: Any) -> None:
        def run_rows(
            self: ParallelContext,
            owners: Sequence[int],
            compute: Callable[[list[int]], torch.Tensor],
        ) -> torch.Tensor:
            by_rank: list[list[int]] = [[] for _ in range(self.cfg_size)]
            for row, rank in enumerate(owners):
                by_rank[rank].append(row)
            mine = compute(by_rank[self.cfg_rank])
            most = max(len(rows) for rows in by_rank)
            padded = mine.new_zeros((most, *mine.shape[1:]))
            padded[: len(mine)] = mine
            out = mine.new_empty((len(owners), *mine.shape[1:]))
            for rows, part in zip(by_rank, self.gather(padded), strict=True):
                if rows:
                    out[torch.tensor(rows, device=out.device)] = part[most - len(rows) :]
            return out

        ParallelContext.run_rows = run_rows  # type: ignore[method-assign]


def branches_swapped() -> Patch:
    return workers_planting(f"{__name__}:SwapGatheredBranches")


def stale_gathered_noise() -> Patch:
    return workers_planting(f"{__name__}:ReuseGatheredNoise")


def owner_plans_differ() -> Patch:
    return workers_planting(f"{__name__}:CountOwnLoadOnly")


def padding_read_first() -> Patch:
    return workers_planting(f"{__name__}:ReadPaddingFirst")


PARALLEL_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="cfg-branches-swapped", mode="step", target="cfg-parallel",
             bug="the gathered guidance branches are put back swapped between ranks",
             patch=branches_swapped),
    Mutation(name="cfg-stale-gathered-noise", mode="request", target="cfg-parallel",
             bug="a rank steps with the noise it gathered for an earlier step",
             patch=stale_gathered_noise),
    Mutation(name="cfg-owner-plans-differ", mode="request", target="cfg-parallel",
             bug="a rank balances unguided requests by its own rows only, so ranks plan "
                 "different owners",
             patch=owner_plans_differ),
    Mutation(name="cfg-padding-read-first", mode="step", target="cfg-parallel",
             bug="a gathered part of an uneven split is read from its end, padding included",
             patch=padding_read_first),
)  # fmt: skip
