"""The denoiser call of a step in which some requests carry a step cache (``docs/caching.md``).

Every decision reads only its own request's rows. A request whose TeaCache
reuses its previous output leaves the call, and its kept raw output rows take
their place. Under the first-block cache every remaining row runs the first
block; a request whose first-block residual barely moved skips the later
blocks and adds its own kept residual of them instead; the others run them as
one smaller batch. With ``rows_per_call`` each part runs in padded chunks of
that size, so a request's output does not depend on its batch mates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from diffusion_runtime.cache_settings import CacheSettings
from diffusion_runtime.pipelines.diffusers.dit_blocks import DiTBlocks
from diffusion_runtime.pipelines.diffusers.step_groups import StepGroup
from diffusion_runtime.pipelines.first_block_cache import FirstBlockCacheState
from diffusion_runtime.pipelines.protocols import StepRequestState
from diffusion_runtime.pipelines.step_cache import TeaCacheState

#: ``call(*tensors)`` run in the adapter's chunks of ``rows_per_call`` rows.
InChunks = Callable[..., torch.Tensor]
#: The denoiser's raw output for stacked inputs, per-row timesteps and conditioning rows.
Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def step_cache_for(settings: CacheSettings | None) -> TeaCacheState | FirstBlockCacheState | None:
    """A fresh cache for a request's settings, or ``None`` when it runs uncached."""
    if settings is None:
        return None
    if settings.backend == "first_block":
        return FirstBlockCacheState(settings)
    return TeaCacheState(settings)


def state_rows(groups: Sequence[StepGroup]) -> list[tuple[StepRequestState, torch.Tensor]]:
    """Each state with the indices of its rows in the stacked denoiser input
    (a guided group stacks every member's rows, then all of them again)."""
    rows: list[tuple[StepRequestState, torch.Tensor]] = []
    offset = 0
    for group in groups:
        sizes = group.sizes()
        total = sum(sizes)
        copies = 2 if group.guidance is not None else 1
        start = offset
        for state, size in zip(group.states, sizes, strict=True):
            parts = [
                torch.arange(start + c * total, start + c * total + size) for c in range(copies)
            ]
            rows.append((state, torch.cat(parts)))
            start += size
        offset += copies * total
    return rows


def cached_denoiser_output(
    groups: Sequence[StepGroup],
    x: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor,
    denoiser: Denoiser,
    blocks: DiTBlocks | None,
    in_chunks: InChunks,
) -> torch.Tensor:
    """The raw denoiser output for every row of ``x``, each request deciding alone."""
    rows = state_rows(groups)
    reused: list[tuple[StepRequestState, torch.Tensor]] = []
    computing: list[tuple[StepRequestState, torch.Tensor]] = []
    for state, index in rows:
        cache = state.step_cache
        # A copy: the latents may be a view of a group's stacked tensor.
        if isinstance(cache, TeaCacheState) and cache.reuses(
            state.latents.clone(), state.step_index, state.num_steps
        ):
            state.step_cached = True
            reused.append((state, index))
        else:
            computing.append((state, index))
    output: torch.Tensor | None = None
    if computing:
        index = torch.cat([i for _, i in computing])
        sizes = [len(i) for _, i in computing]
        x_, t_, labels_ = x[index], t[index], labels[index]
        if blocks is not None and any(
            isinstance(s.step_cache, FirstBlockCacheState) for s, _ in computing
        ):
            states = [s for s, _ in computing]
            part = _first_block_output(states, sizes, x_, t_, labels_, blocks, in_chunks)
        else:
            part = in_chunks(denoiser, x_, t_, labels_)
        output = part.new_empty((len(x), *part.shape[1:]))
        output[index] = part
        for (state, _), rows_ in zip(computing, torch.split(part, sizes), strict=True):
            if isinstance(state.step_cache, TeaCacheState):
                state.step_cache.prediction = rows_.clone()
    for state, index in reused:
        prediction = state.step_cache.prediction
        if output is None:
            output = prediction.new_empty((len(x), *prediction.shape[1:]))
        output[index] = prediction
    assert output is not None
    return output


def first_block_skips(residuals: Sequence[tuple[StepRequestState, torch.Tensor]]) -> list[bool]:
    """Whether each state (with a first-block cache) skips the later blocks this
    step, from its own first-block residual alone."""
    return [
        state.step_cache.skips(residual, state.step_index, state.num_steps)
        for state, residual in residuals
    ]


def _first_block_output(
    states: Sequence[StepRequestState],
    sizes: Sequence[int],
    x: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor,
    blocks: DiTBlocks,
    in_chunks: InChunks,
) -> torch.Tensor:
    """The transformer's output for ``states``' rows (``sizes`` each), the later
    blocks run only for the rows of the states whose first-block cache does not skip."""
    before = in_chunks(blocks.embed, x)
    after_first = in_chunks(blocks.first_block, before, t, labels)
    hidden = after_first.clone()
    running: list[tuple[FirstBlockCacheState | None, slice, torch.Tensor | None]] = []
    deciding: list[tuple[StepRequestState, slice, torch.Tensor]] = []
    start = 0
    for state, size in zip(states, sizes, strict=True):
        rows = slice(start, start + size)
        start += size
        if isinstance(state.step_cache, FirstBlockCacheState):
            deciding.append((state, rows, after_first[rows] - before[rows]))
        else:
            running.append((None, rows, None))
    decisions = first_block_skips([(state, residual) for state, _, residual in deciding])
    for (state, rows, residual), skips in zip(deciding, decisions, strict=True):
        cache: FirstBlockCacheState = state.step_cache
        if skips:
            assert cache.later_residual is not None
            state.step_cached = True
            hidden[rows] = after_first[rows] + cache.later_residual
        else:
            running.append((cache, rows, residual))
    if running:
        index = torch.cat([torch.arange(r.start, r.stop) for _, r, _ in running])
        later = in_chunks(blocks.later_blocks, after_first[index], t[index], labels[index])
        hidden[index] = later
        for kept, rows, first in running:
            if kept is not None and first is not None:
                kept.remember(first, hidden[rows] - after_first[rows])
    return in_chunks(blocks.output, hidden, t, labels)
