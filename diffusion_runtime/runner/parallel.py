"""Handing a pipeline its share of the ranks that share one model (``docs/parallelism.md``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import CollectiveFault, InvalidFieldError
from diffusion_runtime.pipelines.parallel import (
    Gather,
    ParallelContext,
    ParallelLayout,
    SequenceContext,
)

_SEQUENCE_RULE = (
    "must be 1 for {name}: it declares no sequence split (parallel_degrees); "
    "the diffusers DiT family takes it"
)
_RULES = {
    "cfg_parallel_size": "must be 1 for {name}: it declares no guidance branches to split "
    "(parallel_degrees); the digits pipeline and the diffusers DiT and Stable Diffusion "
    "families take it",
    "ulysses_degree": _SEQUENCE_RULE,
    "ring_degree": _SEQUENCE_RULE,
}

#: A process group of this rank, or ``None`` for the whole world.
Group = Any


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
    Every rank creates every subgroup, in the same order, as ``torch.distributed``
    asks; they are destroyed with the world group when the worker stops.
    """
    if config.world_size == 1:
        return
    check_parallel_degrees(pipeline, config)
    if not dist.is_initialized():
        raise RuntimeError(
            "a parallel degree above 1 needs the workers in a torch.distributed group; "
            "the executor did not create one"
        )
    layout = ParallelLayout(config.cfg_parallel_size, config.ulysses_degree, config.ring_degree)
    cfg_rank, ring_rank, ulysses_rank = layout.position(rank)
    cfg_group = _own_group(layout.cfg_groups())
    sequence_group = _own_group(layout.sequence_groups())
    ulysses_group = _own_group(layout.ulysses_groups())
    ring_group = _own_group(layout.ring_groups())
    ring_ranks = next(ranks for ranks in layout.ring_groups() if rank in ranks)
    sequence = None
    if layout.sequence_size > 1:
        sequence = SequenceContext(
            ulysses_rank=ulysses_rank,
            ulysses_size=layout.ulysses,
            ring_rank=ring_rank,
            ring_size=layout.ring,
            gather_tokens=_gather_over(sequence_group, layout.sequence_size),
            all_to_all=_all_to_all_over(ulysses_group),
            ring_shift=_ring_shift_over(ring_group, ring_ranks, ring_rank),
        )
    gather = _gather_over(cfg_group, layout.cfg)
    pipeline.enable_parallel(ParallelContext(cfg_rank, layout.cfg, gather, sequence))


def _own_group(groups: list[list[int]]) -> Group:
    """This rank's group among ``groups`` (a partition of the world), created on
    every rank in the same order; ``None`` (the world) when there is one group,
    and for groups of one rank, over which no collective runs."""
    if len(groups) == 1 or len(groups[0]) == 1:
        return None
    own: Group = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            own = group
    return own


def _gather_over(group: Group, size: int) -> Gather:
    def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in group rank order."""
        if size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(size)]
        with _collective("a gather"):
            dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    return gather


def _all_to_all_over(group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    def all_to_all(tensor: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(tensor)
        with _collective("an all-to-all"):
            dist.all_to_all_single(received, tensor.contiguous(), group=group)
        return received

    return all_to_all


def _ring_shift_over(
    group: Group, ring: list[int], ring_rank: int
) -> Callable[[torch.Tensor], Callable[[], torch.Tensor]]:
    after, before = ring[(ring_rank + 1) % len(ring)], ring[(ring_rank - 1) % len(ring)]

    def ring_shift(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), after, group),
            dist.P2POp(dist.irecv, received, before, group),
        ]
        with _collective("a ring pass"):
            works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            with _collective("a ring pass"):
                for work in works:
                    work.wait()
            return received

        return wait

    return ring_shift


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Turns a failed collective (a peer died or hung past the group's timeout)
    into :class:`CollectiveFault`: the group is broken, so the executor fails,
    not the requests of the step."""
    try:
        yield
    except RuntimeError as exc:
        raise CollectiveFault(f"{what} between ranks failed: {exc}") from exc
