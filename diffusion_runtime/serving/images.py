"""PNG encoding of outputs, and the store behind ``response_format="url"``."""

from __future__ import annotations

import base64
import secrets
import time
from collections import OrderedDict

import numpy as np
import torch

from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.serving.png import encode_png

#: Outputs up to this many values are encoded on the event loop: a thread hop costs more.
INLINE_ENCODE_MAX_VALUES = 65_536


def encodes_inline(output: RequestOutput) -> bool:
    """Whether ``output`` is small enough to encode without leaving the event loop."""
    images = output.image_batch
    return images is None or images.numel() <= INLINE_ENCODE_MAX_VALUES


def png_images(output: RequestOutput) -> list[bytes]:
    """Each image of ``output`` as PNG bytes (grayscale, RGB or RGBA by channel count).

    The same pixels as :meth:`RequestOutput.pil_images`, converted with numpy:
    every torch call lets go of the GIL, and on the server's event loop getting
    it back behind the engine's threads costs far more than the call.
    """
    if output.image_batch is None:
        return []
    pixels = np.clip(output.image_batch.numpy(), 0.0, 1.0) * 255
    batch = pixels.round().astype(np.uint8).transpose(0, 2, 3, 1)
    return [encode_png(image) for image in batch]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def size_of(images: torch.Tensor | None) -> str:
    """``"WIDTHxHEIGHT"`` of an ``(N, C, H, W)`` batch (``"auto"`` when there is none)."""
    if images is None:
        return "auto"
    return f"{images.shape[-1]}x{images.shape[-2]}"


class ImageStore:
    """PNGs kept for their URLs: each for ``ttl_s`` seconds, at most ``capacity`` of them.

    The oldest image goes first when the store is full; expired ones go when
    the store is next touched, so it needs no thread of its own. Names are
    random, so a URL cannot be guessed from another.
    """

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._images: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def put(self, png: bytes) -> str:
        """Keep ``png`` and return its name."""
        self._expire()
        name = secrets.token_urlsafe(16)
        self._images[name] = (time.monotonic() + self.ttl_s, png)
        while len(self._images) > self.capacity:
            self._images.popitem(last=False)
        return name

    def get(self, name: str) -> bytes | None:
        """The PNG called ``name``, or ``None`` if it never existed or has expired."""
        self._expire()
        entry = self._images.get(name)
        return None if entry is None else entry[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._images:
            name, (expires_at, _) = next(iter(self._images.items()))
            if expires_at > now:
                return
            del self._images[name]
