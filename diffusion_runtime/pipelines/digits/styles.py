"""The styles the shipped digits adapters draw, and how to measure them.

Each style redraws the training digits (pixels in ``[0, 1]``); an adapter
trained on the redrawn digits (``train.py``) makes the model draw in that
style. ``read`` turns a drawn image back into a plain one (light digit on a
dark background), so the shipped classifier, fitted on plain digits, can check
that the digit is still the one asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import torch

#: ``bold`` raises every pixel ``p`` to this power: faint stroke edges become ink.
BOLD_EXPONENT = 0.4
#: A pixel brighter than this counts as bright for :func:`bright_fraction`.
BRIGHT_THRESHOLD = 0.5


def _bold(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.pow(BOLD_EXPONENT)


def _invert(pixels: torch.Tensor) -> torch.Tensor:
    return 1.0 - pixels


def _unchanged(pixels: torch.Tensor) -> torch.Tensor:
    return pixels


@attrs.frozen
class Style:
    """How a style redraws a plain digit, and how to read one drawn in it."""

    summary: str
    redraw: Callable[[torch.Tensor], torch.Tensor]
    read: Callable[[torch.Tensor], torch.Tensor]


STYLES: dict[str, Style] = {
    "bold": Style(f"thick strokes: each pixel p becomes p ** {BOLD_EXPONENT}", _bold, _unchanged),
    "inverted": Style("a dark digit on a white background: p becomes 1 - p", _invert, _invert),
}


def adapter_file(name: str) -> str:
    """The file name of the adapter trained for style ``name``."""
    return f"lora-{name}.safetensors"


#: The shipped adapters of the digits model, by style name.
LORA_ADAPTERS: dict[str, Path] = {
    name: Path(__file__).with_name(adapter_file(name)) for name in STYLES
}


def bright_fraction(images: torch.Tensor) -> float:
    """The fraction of pixels brighter than :data:`BRIGHT_THRESHOLD` (images in ``[0, 1]``)."""
    return (images > BRIGHT_THRESHOLD).float().mean().item()
