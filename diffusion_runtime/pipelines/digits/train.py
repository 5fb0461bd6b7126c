"""Train the digits denoiser, its quality-check classifier and its style adapters.

The data are scikit-learn's digits.

Run ``python -m diffusion_runtime.pipelines.digits.train [--steps N] [--seed S] [--out DIR]``;
``--adapters-only`` trains only the style adapters (``styles.py``) on the denoiser in ``DIR``.
Given the seed (and thread count) the written weights are byte-for-byte reproducible.
scikit-learn is needed here only, to load the data set and fit the classifier.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from diffusion_runtime.lora.weights import save_adapter
from diffusion_runtime.pipelines.digits.classifier import CLASSIFIER_WEIGHTS, DigitClassifier
from diffusion_runtime.pipelines.digits.model import (
    PIXELS,
    DenoiserConfig,
    DigitDenoiser,
    cosine_alpha_bars,
)
from diffusion_runtime.pipelines.digits.pipeline import (
    DENOISER_CONFIG,
    DENOISER_WEIGHTS,
    WEIGHTS_DIR,
    DigitsPipeline,
)
from diffusion_runtime.pipelines.digits.styles import STYLES, Style, adapter_file

PIXEL_MAX = 16.0
#: The shipped adapters' recipe: rank per style, optimisation steps and learning rate.
#: (``inverted`` needs rank 16: at rank 8 only 89.5 % of its digits were recognised.)
ADAPTER_RANKS = {"bold": 8, "inverted": 16}
ADAPTER_STEPS = 1500
ADAPTER_LR = 2e-3


def load_digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as pixels ``(N, 64)`` in ``[0, 1]`` and labels ``(N,)``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = torch.from_numpy(np.asarray(data.data, dtype=np.float32) / PIXEL_MAX)
    return pixels, torch.from_numpy(np.asarray(data.target, dtype=np.int64))


def train_denoiser(
    pixels: torch.Tensor,
    labels: torch.Tensor,
    config: DenoiserConfig,
    steps: int,
    seed: int,
    log_every: int = 0,
) -> DigitDenoiser:
    """Fit a new network to the noise-prediction objective; all randomness comes from ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DigitDenoiser(config)
    fit_noise(model, list(model.parameters()), pixels, labels, steps, seed, log_every=log_every)
    return model.eval()


def fit_noise(
    model: DigitDenoiser,
    parameters: list[nn.Parameter],
    pixels: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    seed: int,
    batch_size: int = 256,
    lr: float = 1e-3,
    label_dropout: float = 0.1,
    log_every: int = 0,
) -> None:
    """Train ``parameters`` of ``model`` to predict the noise added to ``pixels``
    (``label_dropout`` of the labels become the null class, for guidance)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    images = pixels * 2 - 1
    alpha_bars = cosine_alpha_bars(config.num_train_timesteps).float()
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps))
    )
    start = time.perf_counter()
    for step in range(1, steps + 1):
        index = torch.randint(len(images), (batch_size,), generator=generator)
        cond = labels[index].clone()
        cond[torch.rand(batch_size, generator=generator) < label_dropout] = config.null_class
        t = torch.randint(config.num_train_timesteps, (batch_size,), generator=generator)
        noise = torch.randn(batch_size, PIXELS, generator=generator)
        ab = alpha_bars[t][:, None]
        noisy = ab.sqrt() * images[index] + (1 - ab).sqrt() * noise
        loss = F.mse_loss(model(noisy, t, cond), noise)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        optimizer.step()
        schedule.step()
        if log_every and step % log_every == 0:
            elapsed = time.perf_counter() - start
            print(f"step {step}/{steps}  loss {loss.item():.4f}  {elapsed:.0f}s", flush=True)


class TrainableLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable update ``B @ (A @ x)`` (alpha = rank).

    ``B`` starts at zero, so training starts from the base network.
    """

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        a = torch.randn(rank, base.in_features, generator=generator) / math.sqrt(base.in_features)
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.lora_a), self.lora_b)
        out: torch.Tensor = self.base(x) + update
        return out


def train_adapter(
    base: DigitDenoiser,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    style: Style,
    rank: int,
    steps: int,
    seed: int,
    lr: float = ADAPTER_LR,
    log_every: int = 0,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Fit a rank-``rank`` adapter on every linear layer of a frozen copy of
    ``base`` to digits redrawn in ``style``; its ``(A, B)`` by layer name
    (for :func:`~diffusion_runtime.lora.weights.save_adapter`, alpha = rank)."""
    model = copy.deepcopy(base).requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    layers: dict[str, TrainableLoRALinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            layers[name] = TrainableLoRALinear(module, rank, generator)
            setattr(model.get_submodule(parent), child, layers[name])
    parameters = [p for layer in layers.values() for p in (layer.lora_a, layer.lora_b)]
    model.train()
    fit_noise(
        model, parameters, style.redraw(pixels), labels, steps, seed, lr=lr, log_every=log_every
    )
    return {name: (layer.lora_a.detach(), layer.lora_b.detach()) for name, layer in layers.items()}


def train_classifier(
    pixels: torch.Tensor, labels: torch.Tensor, seed: int, test_fraction: float = 0.25
) -> tuple[dict[str, torch.Tensor], float]:
    """Fit logistic regression on a stratified split; its tensors and held-out accuracy."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    x_train, x_test, y_train, y_test = train_test_split(
        pixels.numpy(),
        labels.numpy(),
        test_size=test_fraction,
        random_state=seed,
        stratify=labels.numpy(),
    )
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    scale = np.where(std > 0, std, 1.0).astype(np.float32)
    fit = LogisticRegression(C=0.1, max_iter=5000).fit((x_train - mean) / scale, y_train)
    tensors = {
        "mean": torch.from_numpy(mean),
        "scale": torch.from_numpy(scale),
        "weight": torch.from_numpy(fit.coef_.T.astype(np.float32)).contiguous(),
        "bias": torch.from_numpy(fit.intercept_.astype(np.float32)),
    }
    classifier = DigitClassifier(**tensors)
    images = torch.from_numpy(x_test).reshape(-1, 1, 8, 8)
    accuracy = (classifier.predict(images) == torch.from_numpy(y_test)).float().mean().item()
    return tensors, accuracy


def write_denoiser(model: DigitDenoiser, out: Path) -> None:
    """Save the weights as fp16 safetensors next to the JSON config."""
    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / DENOISER_WEIGHTS))
    model.config.save(out / DENOISER_CONFIG)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000, help="denoiser optimisation steps")
    parser.add_argument("--adapter-steps", type=int, default=ADAPTER_STEPS, help="per adapter")
    parser.add_argument(
        "--rank", type=int, default=None, help=f"adapter rank (default: {ADAPTER_RANKS})"
    )
    parser.add_argument(
        "--adapters-only",
        action="store_true",
        help="keep the classifier and denoiser in --out; train only the style adapters",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="output directory")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    pixels, labels = load_digits_data()

    if not args.adapters_only:
        tensors, accuracy = train_classifier(pixels, labels, args.seed)
        save_file(tensors, str(args.out / CLASSIFIER_WEIGHTS.name))
        print(f"classifier held-out accuracy {accuracy:.4f}", flush=True)
        start = time.perf_counter()
        model = train_denoiser(
            pixels, labels, DenoiserConfig(), args.steps, args.seed, log_every=500
        )
        write_denoiser(model, args.out)
        print(f"denoiser: {args.steps} steps in {time.perf_counter() - start:.0f}s -> {args.out}")

    # The adapters adapt the denoiser as the pipeline loads it (from fp16).
    base = DigitsPipeline(weights_dir=args.out).model
    for name, style in STYLES.items():
        start = time.perf_counter()
        rank = ADAPTER_RANKS[name] if args.rank is None else args.rank
        layers = train_adapter(
            base, pixels, labels, style, rank, args.adapter_steps, args.seed, log_every=500
        )
        save_adapter(args.out / adapter_file(name), layers)
        elapsed = time.perf_counter() - start
        print(f"adapter {name} ({style.summary}): {args.adapter_steps} steps in {elapsed:.0f}s")


if __name__ == "__main__":
    main()
