"""``DiTTransformer2DModel.forward`` cut at its first block, for the first-block cache.

The four parts run the forward's own operations in its order, so running
them one after the other gives its output bit for bit (per row, given the
same chunk size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class DiTBlocks:
    """The parts of one DiT transformer's forward."""

    def __init__(self, transformer: Any) -> None:
        self.transformer = transformer

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The patch embedding: ``(B, C, H, W)`` latents to ``(B, tokens, dim)``."""
        hidden: torch.Tensor = self.transformer.pos_embed(x)
        return hidden

    def first_block(
        self, hidden: torch.Tensor, t: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        return self._blocks(self.transformer.transformer_blocks[:1], hidden, t, labels)

    def later_blocks(
        self, hidden: torch.Tensor, t: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        return self._blocks(self.transformer.transformer_blocks[1:], hidden, t, labels)

    def output(self, hidden: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The final norm, projection and unpatchify: the transformer's ``sample``."""
        model = self.transformer
        emb = model.transformer_blocks[0].norm1.emb
        conditioning = emb(t, labels, hidden_dtype=hidden.dtype)
        shift, scale = model.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden = model.norm_out(hidden) * (1 + scale[:, None]) + shift[:, None]
        hidden = model.proj_out_2(hidden)
        side, patch, channels = int(hidden.shape[1] ** 0.5), model.patch_size, model.out_channels
        hidden = hidden.reshape(shape=(-1, side, side, patch, patch, channels))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(shape=(-1, channels, side * patch, side * patch))

    @staticmethod
    def _blocks(
        blocks: Any, hidden: torch.Tensor, t: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        for block in blocks:
            hidden = block(
                hidden,
                attention_mask=None,
                encoder_hidden_states=None,
                encoder_attention_mask=None,
                timestep=t,
                cross_attention_kwargs=None,
                class_labels=labels,
            )
        return hidden
