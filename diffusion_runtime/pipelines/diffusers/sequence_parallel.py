"""Sequence parallelism for the DiT: the ranks of a sequence group split every row's
image tokens, Ulysses-style (an all-to-all trades token shards for attention heads)
and round a ring (keys and values pass from rank to rank, the softmax merged online).

Written here rather than through diffusers' ``enable_parallelism``: in diffusers
0.42 that needs a model with a context-parallel plan (``_cp_plan``, which
``DiTTransformer2DModel`` lacks) and an attention backend that dispatches to the
split (``AttnProcessor2_0`` does not), and its set-up divides by a CUDA device
count on CPU. ``docs/parallelism.md`` says what each degree costs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NoReturn

import attrs
import torch
import torch.nn.functional as F

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.diffusers.dit_blocks import DiTBlocks
from diffusion_runtime.pipelines.parallel import SequenceContext


def check_sequence_split(transformer: Any, context: SequenceContext) -> None:
    """Raise :class:`InvalidFieldError`, naming the degree, when ``transformer``
    cannot be split as ``context`` asks."""
    config = transformer.config
    heads = int(config.num_attention_heads)
    tokens = (int(config.sample_size) // int(config.patch_size)) ** 2
    ulysses = ("ulysses_degree", context.ulysses_size)
    if heads % context.ulysses_size:
        _refuse(ulysses, f"must divide the DiT's {heads} attention heads")
    if tokens % context.size:
        degree = ("ring_degree", context.ring_size) if context.ring_size > 1 else ulysses
        _refuse(degree, f"ulysses_degree * ring_degree must divide the DiT's {tokens} image tokens")
    for block in transformer.transformer_blocks:
        attn = block.attn1
        if type(attn.processor).__name__ != "AttnProcessor2_0" or _has_extras(attn):
            _refuse(
                ulysses,
                "needs the DiT's self-attention on diffusers' AttnProcessor2_0 with no "
                "extra norms or residual (the split re-implements exactly that)",
            )


def _refuse(degree: tuple[str, int], rule: str) -> NoReturn:
    field, value = degree
    raise InvalidFieldError("EngineConfig", field, rule, value)


def _has_extras(attn: Any) -> bool:
    return bool(
        attn.spatial_norm is not None
        or attn.group_norm is not None
        or attn.norm_q is not None
        or attn.norm_k is not None
        or attn.residual_connection
        or attn.rescale_output_factor != 1.0
    )


@attrs.define
class _Sharding:
    """Whether the blocks now run on this rank's token shard (only inside
    :meth:`SequenceParallelDiT.forward`; every other call runs whole rows)."""

    on: bool = False


class SequenceParallelDiT:
    """A DiT transformer whose forward splits every row's tokens over the sequence
    group: each rank embeds the whole latents, keeps its token shard through the
    blocks, and the shards are gathered before the final layer, so every rank of
    the group returns the same whole output.

    Installing it swaps each block's self-attention processor for one that runs
    the split when sharding is on and the original processor otherwise (the
    first-block cache's calls, which run whole rows on every rank).
    """

    def __init__(self, transformer: Any, context: SequenceContext) -> None:
        self.blocks = DiTBlocks(transformer)
        self.context = context
        self._sharding = _Sharding()
        for block in transformer.transformer_blocks:
            original = block.attn1.processor
            block.attn1.set_processor(_SplitAttention(original, context, self._sharding))

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The transformer's ``sample`` for ``x``, computed over the sequence group."""
        context, blocks = self.context, self.blocks
        hidden = blocks.embed(x)
        shard = hidden.chunk(context.size, dim=1)[context.rank]
        with self._sharded():
            shard = blocks.later_blocks(blocks.first_block(shard, t, labels), t, labels)
        whole = torch.cat(context.gather_tokens(shard), dim=1)
        return blocks.output(whole, t, labels)

    @contextlib.contextmanager
    def _sharded(self) -> Iterator[None]:
        self._sharding.on = True
        try:
            yield
        finally:
            self._sharding.on = False


class _SplitAttention:
    """A self-attention processor for a token shard: Ulysses all-to-all to whole
    (ring-chunk) sequences over a slice of the heads, ring attention over the
    chunks, and back."""

    def __init__(self, original: Any, context: SequenceContext, sharding: _Sharding) -> None:
        self.original = original
        self.context = context
        self.sharding = sharding

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not self.sharding.on:
            output: torch.Tensor = self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs
            )
            return output
        batch, tokens, _ = hidden_states.shape
        projections = (attn.to_q, attn.to_k, attn.to_v)
        qkv = torch.stack([project(hidden_states) for project in projections])
        qkv = qkv.view(3, batch, tokens, attn.heads, -1)
        qkv = heads_to_tokens(qkv, self.context)  # (3, B, ring chunk, heads / U, D)
        q, k, v = (part.transpose(1, 2) for part in qkv)  # (B, heads / U, chunk, D)
        out = ring_attention(q, k, v, self.context).transpose(1, 2)
        out = tokens_to_heads(out, self.context).reshape(batch, tokens, -1)
        projected: torch.Tensor = attn.to_out[1](attn.to_out[0](out))
        return projected.to(hidden_states.dtype)


def heads_to_tokens(qkv: torch.Tensor, context: SequenceContext) -> torch.Tensor:
    """``(3, B, s, H, D)`` for this rank's token shard to ``(3, B, U * s, H / U, D)``:
    the Ulysses group's shards, in rank order, over this rank's slice of the heads."""
    size = context.ulysses_size
    if size == 1:
        return qkv
    three, batch, shard, heads, dim = qkv.shape
    blocks = qkv.reshape(three, batch, shard, size, heads // size, dim).permute(3, 0, 1, 2, 4, 5)
    received = context.all_to_all(blocks.contiguous())  # block i: rank i's tokens, our heads
    received = received.permute(1, 2, 0, 3, 4, 5)
    return received.reshape(three, batch, size * shard, heads // size, dim)


def tokens_to_heads(out: torch.Tensor, context: SequenceContext) -> torch.Tensor:
    """The inverse of :func:`heads_to_tokens` for the attention output:
    ``(B, U * s, H / U, D)`` to ``(B, s, H, D)``."""
    size = context.ulysses_size
    if size == 1:
        return out
    batch, chunk, heads, dim = out.shape
    blocks = out.reshape(batch, size, chunk // size, heads, dim).permute(1, 0, 2, 3, 4)
    received = context.all_to_all(blocks.contiguous())  # block i: our tokens, rank i's heads
    return received.permute(1, 2, 0, 3, 4).reshape(batch, chunk // size, size * heads, dim)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: SequenceContext
) -> torch.Tensor:
    """Softmax attention of this rank's queries over the keys and values of every
    ring rank's chunk: each chunk's keys and values pass once round the ring,
    the next pass started before this chunk's scores are computed; the partial
    results merge by their log-sum-exp. ``(B, H, chunk, D)`` in and out."""
    if context.ring_size == 1:
        return F.scaled_dot_product_attention(q, k, v)
    scale = q.shape[-1] ** -0.5
    kv = torch.stack([k, v])
    out: torch.Tensor | None = None
    total: torch.Tensor | None = None
    for step in range(context.ring_size):
        arriving = context.ring_shift(kv) if step + 1 < context.ring_size else None
        scores = torch.matmul(q, kv[0].transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        part = torch.matmul(torch.exp(scores - lse), kv[1])
        if out is None or total is None:
            out, total = part, lse
        else:
            merged = torch.logaddexp(total, lse)
            out = out * torch.exp(total - merged) + part * torch.exp(lse - merged)
            total = merged
        if arriving is not None:
            kv = arriving()
    assert out is not None
    return out
