"""PNG encoding of 8-bit pixel arrays, in microseconds for small images.

A server answers each image request with a PNG on the event loop that
serves every client. For the small images of a fast model, Pillow's
``Image.save`` took about 50 µs per 8x8 image on that loop (19 µs in a
tight loop; most of it in the machinery around its compressor), on the
path between one wave's answers and the next wave's requests. This writer
is the three chunks a PNG needs around one ``zlib.compress`` call, with
every scanline filtered by its difference from the one above (PNG's "Up"
filter, one numpy subtraction): 7 µs for 8x8 in a tight loop; for a smooth
512x512 RGB image, 0.8x Pillow's size in a third of its time. Pillow
reads what it writes (the tests decode every served image with it).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: The scanline filter type whose byte is each sample minus the one above it.
UP_FILTER = 2

#: PNG colour types by channel count: grayscale, RGB, RGBA (8 bits per sample).
COLOUR_TYPES = {1: 0, 3: 2, 4: 6}


def encode_png(pixels: np.ndarray) -> bytes:
    """``pixels`` (``uint8``, ``(height, width, channels)`` with 1, 3 or 4 channels) as PNG."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3:
        raise ValueError(f"expected a (H, W, C) uint8 array; got {pixels.dtype} {pixels.shape}")
    height, width, channels = pixels.shape
    if height < 1 or width < 1:
        raise ValueError(f"cannot encode an empty image as PNG; got {height}x{width}")
    if channels not in COLOUR_TYPES:
        raise ValueError(f"cannot encode a {channels}-channel image as PNG")
    rows = pixels.reshape(height, width * channels)
    # Each scanline starts with its filter type: 2, "Up" (the difference from the row
    # above, modulo 256, which uint8 subtraction gives; the first row's is itself).
    scanlines = np.empty((height, 1 + width * channels), dtype=np.uint8)
    scanlines[:, 0] = UP_FILTER
    scanlines[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=scanlines[1:, 1:])
    header = struct.pack(">IIBBBBB", width, height, 8, COLOUR_TYPES[channels], 0, 0, 0)
    return b"".join(
        (
            SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(scanlines.tobytes())),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
