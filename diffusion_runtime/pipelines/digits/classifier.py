"""A logistic-regression digit classifier (pure torch at inference) for quality checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from diffusion_runtime.pipelines.digits.model import IMAGE_SIZE, PIXELS
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.sampling_params import SamplingParams

CLASSIFIER_WEIGHTS = Path(__file__).with_name("classifier.safetensors")
NUM_DIGITS = 10


class SamplingPipeline(Protocol):
    """What :func:`recognition_rate` needs: a request-mode pipeline that names its device."""

    device: torch.device

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]: ...


class DigitClassifier:
    """Multinomial logistic regression on the 64 standardised pixels of an 8x8 digit."""

    def __init__(
        self, mean: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> None:
        self.mean = mean
        self.scale = scale
        self.weight = weight
        self.bias = bias

    @classmethod
    def load(
        cls, path: str | Path = CLASSIFIER_WEIGHTS, device: torch.device | str = "cpu"
    ) -> DigitClassifier:
        """Load weights written by the training script (the shipped ones by default)."""
        t = {k: v.float().to(device) for k, v in load_file(str(path)).items()}
        return cls(t["mean"], t["scale"], t["weight"], t["bias"])

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores ``(N, 10)`` for images ``(N, 1, H, W)`` in ``[0, 1]``.

        Images larger than 8x8 are average-pooled down to 8x8 first.
        """
        if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
            images = F.adaptive_avg_pool2d(images, IMAGE_SIZE)
        pixels = images.reshape(-1, PIXELS).to(self.weight)
        return ((pixels - self.mean) / self.scale) @ self.weight + self.bias

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """The predicted digit ``(N,)`` of each image ``(N, 1, H, W)`` in ``[0, 1]``."""
        return self.logits(images).argmax(dim=1)


def recognition_rates(
    images: torch.Tensor, labels: torch.Tensor, classifier: DigitClassifier | None = None
) -> tuple[float, dict[int, float]]:
    """Fraction of ``images`` classified as their requested ``labels``: overall and per digit."""
    classifier = classifier or DigitClassifier.load(device=images.device)
    labels = labels.to(images.device)
    hits = classifier.predict(images) == labels
    per_digit = {
        digit: hits[labels == digit].float().mean().item()
        for digit in range(NUM_DIGITS)
        if bool((labels == digit).any())
    }
    return hits.float().mean().item(), per_digit


def recognition_rate(
    pipeline: SamplingPipeline,
    samples_per_digit: int,
    num_inference_steps: int,
    seed: int,
    guidance_scale: float = 1.0,
    classifier: DigitClassifier | None = None,
) -> tuple[float, dict[int, float]]:
    """Sample ``samples_per_digit`` images of each digit in one batch and score them.

    Digit ``d`` is one request with seed ``seed + d``.
    """
    requests = [
        PipelineRequest(
            request_id=f"digit-{digit}",
            prompt=str(digit),
            params=SamplingParams(
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                num_outputs_per_prompt=samples_per_digit,
            ),
            seed=seed + digit,
            device=pipeline.device,
        )
        for digit in range(NUM_DIGITS)
    ]
    outputs = pipeline.forward(requests)
    images = torch.cat([outputs[r.request_id] for r in requests])
    labels = torch.arange(NUM_DIGITS).repeat_interleave(samples_per_digit)
    return recognition_rates(images, labels, classifier)
