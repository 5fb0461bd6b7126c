"""What a pipeline gets to split one forward between the ranks that share its model.

The worker builds a :class:`ParallelContext` when a parallel degree is above 1
and hands it to the pipeline's ``enable_parallel`` (``docs/parallelism.md``);
a pipeline declares the degrees it takes in ``parallel_degrees``. The context
holds no global state: its ``gather`` is the only way it reaches the other ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

#: Gathers one equally shaped tensor from every rank of a split, in rank order.
Gather = Callable[[torch.Tensor], list[torch.Tensor]]

#: A block of stacked rows: its row count, and the guidance branch it belongs to
#: (0: conditional, 1: unconditional), or ``None`` for rows without guidance.
RowBlock = tuple[int, int | None]


@attrs.frozen
class ParallelContext:
    """This rank's place in the CFG-parallel split, and the gather across it.

    Every rank plans the same split from the same batch, so the row counts
    each rank computes are known everywhere and no sizes cross the wire.
    """

    cfg_rank: int
    cfg_size: int
    gather: Gather

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
                out[torch.tensor(rows, device=out.device)] = part[: len(rows)]
        return out
