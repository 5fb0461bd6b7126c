"""The digits denoiser network, its cosine noise schedule and the DDIM update.

The network predicts the noise in a flattened 8x8 image (64 values in
``[-1, 1]``), conditioned on the timestep and the digit class. Class index
``num_classes`` is the "null" class used for classifier-free guidance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from diffusion_runtime.lora.layers import AdapterPlan, RowAdapters
from diffusion_runtime.trajectory import gaussian_log_density

IMAGE_SIZE = 8
PIXELS = IMAGE_SIZE * IMAGE_SIZE
TIME_FEATURES = 64


@attrs.frozen
class DenoiserConfig:
    """Architecture and schedule of a :class:`DigitDenoiser`."""

    hidden: int = 256
    blocks: int = 3
    num_train_timesteps: int = 1000
    schedule: str = "cosine"
    num_classes: int = 10

    @property
    def null_class(self) -> int:
        """The label meaning "no class" (the unconditional branch of guidance)."""
        return self.num_classes

    def save(self, path: Path) -> None:
        """Write the config as JSON."""
        path.write_text(json.dumps(attrs.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> DenoiserConfig:
        """Read a config written by :meth:`save`."""
        config = cls(**json.loads(path.read_text()))
        if config.schedule != "cosine":
            raise ValueError(f"unsupported noise schedule {config.schedule!r}")
        return config


def cosine_alpha_bars(num_timesteps: int, offset: float = 0.008) -> torch.Tensor:
    """Cumulative signal fractions ``alpha_bar[t]`` of the cosine schedule (float64)."""
    steps = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
    f = torch.cos((steps + offset) / (1 + offset) * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, dim=0)


def timestep_features(t: torch.Tensor, num_timesteps: int) -> torch.Tensor:
    """Sinusoidal features of integer timesteps, shape ``(B, TIME_FEATURES)``."""
    half = TIME_FEATURES // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=t.device) / half)
    angles = (t.float() * (1000.0 / num_timesteps))[:, None] * freqs[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class FiLMBlock(nn.Module):
    """Pre-norm residual MLP block whose normalised input is scaled and shifted by the embedding."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.film = nn.Linear(hidden, 2 * hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.film(emb).chunk(2, dim=1)
        z = self.norm(h) * (1 + scale) + shift
        update: torch.Tensor = self.fc2(F.silu(self.fc1(z)))
        return h + update


class DigitDenoiser(nn.Module):
    """Residual MLP predicting the noise of a flattened 8x8 image."""

    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden
        self.time_mlp = nn.Sequential(
            nn.Linear(TIME_FEATURES, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )
        self.class_emb = nn.Embedding(config.num_classes + 1, hidden)
        self.inp = nn.Linear(PIXELS, hidden)
        self.blocks = nn.ModuleList(FiLMBlock(hidden) for _ in range(config.blocks))
        self.out_norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, PIXELS)

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The noise in ``x`` ``(B, 64)``, given timesteps ``t`` and ``labels`` (both ``(B,)``)."""
        emb = self.time_mlp(timestep_features(t, self.config.num_train_timesteps))
        emb = F.silu(emb + self.class_emb(labels))
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, emb)
        out: torch.Tensor = self.out(self.out_norm(h))
        return out

    def predict_noise_row_stable(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        labels: torch.Tensor,
        rows_per_call: int,
        adapters: AdapterPlan | None = None,
    ) -> torch.Tensor:
        """:meth:`forward`, run in zero-padded chunks of exactly ``rows_per_call`` rows.

        Why: BLAS picks its GEMM kernel from the matrix shape. On the CPU build
        measured (MKL sgemm, AVX-512), ``nn.Linear`` gives different last bits
        for a row when the batch has M=1 rows (a GEMV path) or M in
        {2, 3, 5, 6, 7, 9, 10, 11} (a small-M path), so a request's image would
        depend on how many batch mates it had. Every GEMM here has the same
        shape whatever the batch, and within one fixed shape a row's result
        does not depend on its position or on the other rows (checked in the
        tests), so each row's output depends on that row alone. The other ops
        (LayerNorm, SiLU, sin/cos) then also always see the same shapes, so
        their vectorised/scalar split cannot vary with the batch either.

        ``adapters``: the slots installed in this network, and each row's slot
        and scale (slot 0: no adapter). A chunk with an adapter row runs the
        batched LoRA path for all its rows, again with fixed shapes; a row of
        slot 0 gets an update of exactly zero, so it keeps its base output.
        """
        n = x.shape[0]
        pad = -n % rows_per_call
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            t = torch.cat([t, t.new_zeros(pad)])
            labels = torch.cat([labels, labels.new_full((pad,), self.config.null_class)])
        chunks = []
        for i in range(0, n + pad, rows_per_call):
            rows = slice(i, i + rows_per_call)
            with self._adapter_rows(adapters, rows, pad):
                chunks.append(self(x[rows], t[rows], labels[rows]))
        return torch.cat(chunks)[:n]

    def _adapter_rows(
        self,
        adapters: AdapterPlan | None,
        rows: slice,
        pad: int,
    ) -> AbstractContextManager[None]:
        """Set the adapters of one chunk's rows (padding rows have none)."""
        if adapters is None:
            return nullcontext()
        slots, row_slots, row_scales = adapters
        chunk_slots = (row_slots + [0] * pad)[rows]
        if not any(chunk_slots):
            return nullcontext()
        return slots.rows_using(
            RowAdapters(
                torch.tensor(chunk_slots, dtype=torch.long, device=slots.device),
                torch.tensor((row_scales + [0.0] * pad)[rows], device=slots.device),
            )
        )


def ddim_timesteps(num_inference_steps: int, num_train_timesteps: int) -> list[int]:
    """``num_inference_steps`` distinct timesteps, evenly spaced from ``T - 1`` down to 0."""
    if num_inference_steps == 1:
        return [num_train_timesteps - 1]
    span = num_train_timesteps - 1
    return [round(span * (1 - i / (num_inference_steps - 1))) for i in range(num_inference_steps)]


@attrs.define(eq=False)
class DDIMScheduler:
    """DDIM for one request; keeps the latest clean-image estimate.

    With ``eta`` 0 (the default) every step is deterministic. With ``eta`` > 0
    each step but the last adds noise of standard deviation
    :meth:`sigma` (``eta`` 1 is DDPM's posterior), drawn by the caller, and
    records its Gaussian log-density in ``log_prob``.
    """

    alpha_bars: Sequence[float]
    timesteps: Sequence[int]
    eta: float = 0.0
    x0: torch.Tensor | None = None
    #: The log-density of the last step's sample, one value per row (``None``
    #: for a step that drew no noise).
    log_prob: torch.Tensor | None = None

    def draws_noise(self, index: int) -> bool:
        """Whether step ``index`` adds noise (and so needs ``noise`` in :meth:`step`)."""
        return self.eta > 0 and index + 1 < len(self.timesteps)

    def sigma(self, index: int) -> float:
        """The standard deviation of the noise step ``index`` adds."""
        ab = self.alpha_bars[self.timesteps[index]]
        ab_next = self.alpha_bars[self.timesteps[index + 1]]
        return self.eta * math.sqrt((1 - ab_next) / (1 - ab) * (1 - ab / ab_next))

    def step(
        self, x: torch.Tensor, eps: torch.Tensor, index: int, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Move ``x`` from ``timesteps[index]`` to the next timestep (or to the clean
        image); ``noise`` (standard normal, shaped like ``x``) when :meth:`draws_noise`."""
        ab = self.alpha_bars[self.timesteps[index]]
        x0 = torch.sub(x, eps, alpha=math.sqrt(1 - ab)).div_(math.sqrt(ab)).clamp_(-1.0, 1.0)
        self.x0 = x0
        self.log_prob = None
        if index + 1 == len(self.timesteps):
            return x0
        ab_next = self.alpha_bars[self.timesteps[index + 1]]
        if not self.draws_noise(index):
            # sqrt(ab_next) * x0 + sqrt(1 - ab_next) * noise, where the noise is the one
            # implied by x and the clipped x0, (x - sqrt(ab) * x0) / sqrt(1 - ab).
            ratio = math.sqrt((1 - ab_next) / (1 - ab))
            return torch.add(x.mul(ratio), x0, alpha=math.sqrt(ab_next) - ratio * math.sqrt(ab))
        if noise is None:
            raise ValueError(f"DDIM step {index} with eta {self.eta} needs noise")
        sigma = self.sigma(index)
        implied = torch.sub(x, x0, alpha=math.sqrt(ab)).div_(math.sqrt(1 - ab))
        mean = torch.add(
            x0.mul(math.sqrt(ab_next)), implied, alpha=math.sqrt(1 - ab_next - sigma**2)
        )
        sample = torch.add(mean, noise, alpha=sigma)
        self.log_prob = gaussian_log_density(sample, mean, sigma)
        return sample
