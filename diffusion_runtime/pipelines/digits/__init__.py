"""The built-in ``digits`` pipeline: class-conditional diffusion of 8x8 handwritten digits."""

from diffusion_runtime.pipelines.digits.classifier import (
    DigitClassifier,
    recognition_rate,
    recognition_rates,
)
from diffusion_runtime.pipelines.digits.pipeline import DigitsPipeline

__all__ = ["DigitClassifier", "DigitsPipeline", "recognition_rate", "recognition_rates"]
