"""PNG encoding of outputs, and the store behind ``response_format="url"``."""

from __future__ import annotations

import base64
import io
import secrets
import time
from collections import OrderedDict

import torch

from diffusion_runtime.outputs import RequestOutput


def png_images(output: RequestOutput) -> list[bytes]:
    """Each image of ``output`` as PNG bytes."""
    encoded = []
    for image in output.pil_images():
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return encoded


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

    def __len__(self) -> int:
        return len(self._images)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._images:
            name, (expires_at, _) = next(iter(self._images.items()))
            if expires_at > now:
                return
            del self._images[name]
