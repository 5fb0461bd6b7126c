"""What a pipeline gets to split one forward between the ranks that share its model.

The worker builds a :class:`ParallelContext` when a parallel degree is above 1
and hands it to the pipeline's ``enable_parallel`` (``docs/parallelism.md``);
a pipeline declares the degrees it takes in ``parallel_degrees``. The context
holds no global state: its collectives (``gather``, and the sequence split's
in :class:`SequenceContext`) are the only ways it reaches the other ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

#: Gathers one equally shaped tensor from every rank of a split, in rank order.
Gather = Callable[[torch.Tensor], list[torch.Tensor]]

#: Trades equally shaped blocks along dim 0 with the ranks of a group: block ``i``
#: goes to rank ``i``, and block ``i`` of the result came from rank ``i``.
AllToAll = Callable[[torch.Tensor], torch.Tensor]

#: Starts sending a tensor to the next rank of the ring and receiving the previous
#: rank's (same shape); the returned call waits and gives the received one.
RingShift = Callable[[torch.Tensor], Callable[[], torch.Tensor]]

#: A block of stacked rows: its row count, and the guidance branch it belongs to
#: (0: conditional, 1: unconditional), or ``None`` for rows without guidance.
RowBlock = tuple[int, int | None]


@attrs.frozen
class ParallelLayout:
    """Where each global rank sits in the split: ``rank = (cfg_rank * ring + ring_rank)
    * ulysses + ulysses_rank``.

    The ranks of one CFG rank form its sequence group (its ``ulysses * ring``
    ranks split every row's tokens, shard ``ring_rank * ulysses + ulysses_rank``
    on each); within it, the ranks of one ring rank trade heads (Ulysses) and
    those of one Ulysses rank pass keys and values round the ring.
    """

    cfg: int
    ulysses: int
    ring: int

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses * self.ring

    @property
    def sequence_size(self) -> int:
        """The ranks that split one row's tokens."""
        return self.ulysses * self.ring

    def position(self, rank: int) -> tuple[int, int, int]:
        """``(cfg_rank, ring_rank, ulysses_rank)`` of a global rank."""
        cfg_rank, sequence_rank = divmod(rank, self.sequence_size)
        ring_rank, ulysses_rank = divmod(sequence_rank, self.ulysses)
        return cfg_rank, ring_rank, ulysses_rank

    def cfg_groups(self) -> list[list[int]]:
        """The ranks that split guidance branches: one per place in a sequence group."""
        size = self.sequence_size
        return [[c * size + s for c in range(self.cfg)] for s in range(size)]

    def sequence_groups(self) -> list[list[int]]:
        """The ranks that split one row's tokens, in shard order."""
        size = self.sequence_size
        return [list(range(c * size, (c + 1) * size)) for c in range(self.cfg)]

    def ulysses_groups(self) -> list[list[int]]:
        """The ranks that trade attention heads for tokens (one ring rank's)."""
        return [
            list(range(start, start + self.ulysses))
            for start in range(0, self.world_size, self.ulysses)
        ]

    def ring_groups(self) -> list[list[int]]:
        """The ranks that pass keys and values round a ring (one Ulysses rank's), in ring order."""
        size, step = self.sequence_size, self.ulysses
        return [
            [c * size + r * step + u for r in range(self.ring)]
            for c in range(self.cfg)
            for u in range(self.ulysses)
        ]


@attrs.frozen
class SequenceContext:
    """This rank's place in the split of one row's tokens, and the collectives
    across it (``docs/parallelism.md``, sequence parallelism).

    ``gather_tokens`` gathers over the ``ulysses * ring`` ranks of the sequence
    group in shard order; ``all_to_all`` runs over the Ulysses group and
    ``ring_shift`` round the ring group (each unused at size 1).
    """

    ulysses_rank: int
    ulysses_size: int
    ring_rank: int
    ring_size: int
    gather_tokens: Gather
    all_to_all: AllToAll
    ring_shift: RingShift

    @property
    def size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        """Which token shard this rank holds."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


@attrs.frozen
class ParallelContext:
    """This rank's place in the CFG-parallel split, the gather across it, and
    the sequence split (``None`` with ``ulysses_degree`` and ``ring_degree`` at 1).

    Every rank plans the same split from the same batch, so the row counts
    each rank computes are known everywhere and no sizes cross the wire. The
    ranks of one sequence group share a CFG rank and so compute the same rows.
    """

    cfg_rank: int
    cfg_size: int
    gather: Gather
    sequence: SequenceContext | None = None

    def row_owners(self, blocks: Sequence[RowBlock]) -> list[int]:
        """The CFG rank that computes each row: a guidance branch goes to the rank
        of its index; a block without guidance goes whole to the rank with the
        fewest rows so far (the lowest such rank), so requests are split between
        ranks."""
        loads = [0] * self.cfg_size
        owners: list[int] = []
        for rows, branch in blocks:
            rank = loads.index(min(loads)) if branch is None else branch % self.cfg_size
            loads[rank] += rows
            owners += [rank] * rows
        return owners

    def run_rows(
        self, owners: Sequence[int], compute: Callable[[list[int]], torch.Tensor]
    ) -> torch.Tensor:
        """Every row's result, computed on its owner and gathered to every rank.

        ``compute(rows)`` returns the results of the given row indices, in order
        (possibly none). Each rank's part is padded to the largest part for the
        gather; a row-wise computation then gives every rank the same bits as
        one rank computing all rows.
        """
        by_rank: list[list[int]] = [[] for _ in range(self.cfg_size)]
        for row, rank in enumerate(owners):
            by_rank[rank].append(row)
        mine = compute(by_rank[self.cfg_rank])
        most = max(len(rows) for rows in by_rank)
        padded = mine.new_zeros((most, *mine.shape[1:]))
        padded[: len(mine)] = mine
        parts = self.gather(padded)
        out = mine.new_empty((len(owners), *mine.shape[1:]))
        for rows, part in zip(by_rank, parts, strict=True):
            if rows:
                out[torch.tensor(rows, device=out.device)] = self.unpadded(part, len(rows))
        return out

    @staticmethod
    def unpadded(part: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` real rows of a gathered part (the padding follows them)."""
        return part[:count]
