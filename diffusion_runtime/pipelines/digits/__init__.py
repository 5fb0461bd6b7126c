"""The built-in ``digits`` pipeline: class-conditional diffusion of 8x8 handwritten digits."""

from diffusion_runtime.pipelines.digits.classifier import (
    DigitClassifier,
    recognition_rate,
    recognition_rates,
)
from diffusion_runtime.pipelines.digits.pipeline import DigitsPipeline
from diffusion_runtime.pipelines.digits.styles import LORA_ADAPTERS

__all__ = [
    "LORA_ADAPTERS",
    "DigitClassifier",
    "DigitsPipeline",
    "recognition_rate",
    "recognition_rates",
]
