"""Bugs in the ranks that share one model: CFG-parallel digits and the
sequence-split DiT over mp workers.

Worker processes are spawned, so a patch in this process never reaches them:
:func:`workers_planting` makes the mp workers started while it is open load a
worker extension that plants the bug in each worker before it serves. The
``cfg-parallel`` target's direct oracle runs the pipeline in this process with
every degree at 1, so a split that changes one bit of an image fails there;
the ``ulysses`` and ``ring`` targets' oracle allows float rounding only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.executor.mp import executor as mp_executor
from diffusion_runtime.pipelines.diffusers import sequence_parallel
from diffusion_runtime.pipelines.parallel import ParallelContext, RowBlock, SequenceContext
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
        ParallelContext.unpadded = staticmethod(  # type: ignore[method-assign]
            lambda part, count: part[len(part) - count :]
        )


class ReverseReturnedHeads:
    """Plants: the attention output's all-to-all back reads the ranks' head
    slices in reverse rank order, so each token's heads come back swapped."""

    def __init__(self, worker: Any) -> None:
        original = sequence_parallel.tokens_to_heads

        def tokens_to_heads(out: torch.Tensor, context: SequenceContext) -> torch.Tensor:
            reversed_return = attrs.evolve(
                context, all_to_all=lambda tensor: context.all_to_all(tensor).flip(0)
            )
            return original(out, reversed_return)

        sequence_parallel.tokens_to_heads = tokens_to_heads


class KeepOwnRingChunk:
    """Plants: a rank reads the ring's send buffer for the pass it waited on, so
    it attends its own keys and values again instead of its neighbour's."""

    def __init__(self, worker: Any) -> None:
        original = sequence_parallel.ring_attention

        def ring_attention(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: SequenceContext
        ) -> torch.Tensor:
            def ring_shift(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
                wait = context.ring_shift(tensor)

                def read_sent() -> torch.Tensor:
                    wait()
                    return tensor

                return read_sent

            return original(q, k, v, attrs.evolve(context, ring_shift=ring_shift))

        sequence_parallel.ring_attention = ring_attention


class ShardByUlyssesRank:
    """Plants: a rank picks its token shard by its Ulysses rank alone, so the
    ranks of a ring all keep the same shard."""

    def __init__(self, worker: Any) -> None:
        SequenceContext.rank = property(  # type: ignore[method-assign,assignment]
            lambda self: self.ulysses_rank
        )


def branches_swapped() -> Patch:
    return workers_planting(f"{__name__}:SwapGatheredBranches")


def stale_gathered_noise() -> Patch:
    return workers_planting(f"{__name__}:ReuseGatheredNoise")


def owner_plans_differ() -> Patch:
    return workers_planting(f"{__name__}:CountOwnLoadOnly")


def padding_read_first() -> Patch:
    return workers_planting(f"{__name__}:ReadPaddingFirst")


def heads_reversed() -> Patch:
    return workers_planting(f"{__name__}:ReverseReturnedHeads")


def ring_chunk_kept() -> Patch:
    return workers_planting(f"{__name__}:KeepOwnRingChunk")


def shard_by_ulysses_rank() -> Patch:
    return workers_planting(f"{__name__}:ShardByUlyssesRank")


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
    Mutation(name="ulysses-heads-reversed", mode="request", target="ulysses",
             bug="the attention output's all-to-all back puts the ranks' head slices in "
                 "reverse order",
             patch=heads_reversed),
    Mutation(name="ring-own-chunk-kept", mode="step", target="ring",
             bug="a rank attends its own keys and values again instead of the ones the "
                 "ring passed it",
             patch=ring_chunk_kept),
    Mutation(name="ring-shard-by-ulysses-rank", mode="request", target="ring",
             bug="a rank picks its token shard by its Ulysses rank alone, so every ring "
                 "rank keeps the same tokens",
             patch=shard_by_ulysses_rank),
)  # fmt: skip
