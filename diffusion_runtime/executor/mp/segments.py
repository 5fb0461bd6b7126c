"""Shared-memory transport for output tensors: rank 0 writes, the executor copies out.

Writing into freshly created shared memory is slow (every page is allocated
and zeroed on first touch: 2-5 ms for a 3 MB image on the machines we
measured), while rewriting a mapped segment costs one memcpy. So rank 0 keeps
a small pool of segments (:class:`OutputArena`): a wave's images are packed
into one leased segment, the executor copies each request's images into its
own tensor and hands the lease back with a ``ReleaseSegment`` message, and
the segment is reused by a later wave. At most :data:`MAX_IDLE_SEGMENTS` idle
segments are kept; others are unlinked.

Segments are files under ``/dev/shm`` (a temporary directory where there is
none) named ``diffusion-rt-<engine pid>-<executor token>-r<rank>-<n>``: the
executor can always find and unlink what a crashed worker left (:func:`sweep`),
and an operator can tell which process a segment belongs to. Space is reserved with
``posix_fallocate`` so a full ``/dev/shm`` is an ``OSError`` on creation, not
a ``SIGBUS`` on write.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy
import torch

from diffusion_runtime.errors import EngineDeadError
from diffusion_runtime.executor.failure import SHUT_DOWN
from diffusion_runtime.executor.mp.messages import ImageSlot

logger = logging.getLogger(__name__)

#: Every segment the runtime creates starts with this.
SEGMENT_PREFIX = "diffusion-rt-"
SEGMENT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
MAX_IDLE_SEGMENTS = 2
#: Outputs up to this size travel inside their message: below it a segment's
#: lease and hand-back cost more than the copy through the pipe.
INLINE_OUTPUT_BYTES = 256 * 1024
_MIN_CAPACITY = 1 << 20
_ALIGN = 64


class Segment:
    """One named shared-memory file, mapped read-write, exposed as a uint8 array.

    Views are numpy arrays, which hold a buffer export on the mapping: closing
    a mapping that still has views raises instead of leaving them dangling.
    """

    def __init__(self, name: str, size: int = 0, *, create: bool = False) -> None:
        self.name = name
        path = os.path.join(SEGMENT_DIR, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                _reserve(fd, size)
            else:
                size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.capacity = size
        self.bytes: numpy.ndarray[Any, numpy.dtype[numpy.uint8]] | None = numpy.frombuffer(
            self._mmap, dtype=numpy.uint8
        )

    def close(self) -> None:
        self.bytes = None
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            logger.warning("segment %s still has views; leaving its mapping to them", self.name)

    def unlink(self) -> None:
        unlink_segment(self.name)


class OutputArena:
    """Rank 0's segment pool: packs a wave's images into a leased segment.

    Thread-safe: the packer (or main) thread leases, the side thread releases.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._idle: list[Segment] = []  # least recently released first
        self._leased: dict[str, Segment] = {}
        self._retired: list[str] = []

    def pack(
        self, tensors: Sequence[tuple[str, str, torch.Tensor]]
    ) -> tuple[str | None, tuple[ImageSlot, ...], tuple[str, ...]]:
        """Copy ``(field, request id, tensor)`` triples into a leased segment.

        Returns the segment's name (None when there are no bytes to copy), the
        slots in the order given, and the names of segments retired since the
        last call.
        """
        slots, total = layout(tensors)
        with self._lock:
            if total == 0:
                return None, slots, self._take_retired()
            segment = self._lease(total)
            try:
                assert segment.bytes is not None
                write_slots(segment.bytes, slots, tensors)
            except BaseException:
                self._leased.pop(segment.name)
                self._idle.append(segment)
                raise
            return segment.name, slots, self._take_retired()

    def release(self, name: str) -> None:
        """Return a leased segment to the pool (unknown names are ignored)."""
        with self._lock:
            segment = self._leased.pop(name, None)
            if segment is None:
                return
            self._idle.append(segment)
            while len(self._idle) > MAX_IDLE_SEGMENTS:
                self._retire(self._idle.pop(0))

    def unlink_all(self) -> None:
        """Remove every segment's name (mappings stay valid); for a worker about to vanish."""
        with self._lock:
            for segment in [*self._idle, *self._leased.values()]:
                segment.unlink()

    def close(self) -> None:
        """Unmap and unlink every segment, leased or idle."""
        with self._lock:
            segments = [*self._idle, *self._leased.values()]
            self._idle.clear()
            self._leased.clear()
            for segment in segments:
                segment.close()
                segment.unlink()

    def _lease(self, nbytes: int) -> Segment:
        fitting = [s for s in self._idle if nbytes <= s.capacity <= max(4 * nbytes, _MIN_CAPACITY)]
        if fitting:
            segment = min(fitting, key=lambda s: s.capacity)
            self._idle.remove(segment)
        else:
            capacity = -(-nbytes // _MIN_CAPACITY) * _MIN_CAPACITY
            segment = Segment(f"{self._prefix}{next(self._numbers)}", capacity, create=True)
        self._leased[segment.name] = segment
        return segment

    def _retire(self, segment: Segment) -> None:
        segment.close()
        segment.unlink()
        self._retired.append(segment.name)

    def _take_retired(self) -> tuple[str, ...]:
        retired = tuple(self._retired)
        self._retired.clear()
        return retired


class OutputReader:
    """The executor's mappings of rank 0's segments: copies images out of them.

    Mappings are kept between waves (mapping a segment costs more than the
    copy) and dropped when rank 0 reports the segment retired.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[str, Segment] = {}
        self._closed = False

    def copy_out(
        self,
        name: str | None,
        inline: bytes,
        slots: Sequence[ImageSlot],
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Read ``slots`` from segment ``name``, or from ``inline`` when it is None."""
        with self._lock:
            if self._closed:
                raise EngineDeadError(SHUT_DOWN)
            if name is None:
                return read_slots(numpy.frombuffer(inline, dtype=numpy.uint8), slots)
            segment = self._mapped.get(name)
            if segment is None:
                segment = self._mapped[name] = Segment(name)
            assert segment.bytes is not None
            return read_slots(segment.bytes, slots)

    def forget(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                segment = self._mapped.pop(name, None)
                if segment is not None:
                    segment.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for segment in self._mapped.values():
                segment.close()
            self._mapped.clear()


def unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SEGMENT_DIR, name))


def segment_names(prefix: str) -> list[str]:
    """Names of existing segments that start with ``prefix``."""
    return sorted(name for name in os.listdir(SEGMENT_DIR) if name.startswith(prefix))


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; return their names."""
    names = segment_names(prefix)
    for name in names:
        unlink_segment(name)
    return names


def layout(tensors: Sequence[tuple[str, str, torch.Tensor]]) -> tuple[tuple[ImageSlot, ...], int]:
    """Where each ``(field, request id, tensor)`` goes in one buffer, and its total size."""
    slots = []
    offset = 0
    for field, request_id, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        slots.append(ImageSlot(field, request_id, offset, nbytes, tuple(tensor.shape), dtype))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(slots), offset


def pack_inline(
    tensors: Sequence[tuple[str, str, torch.Tensor]],
) -> tuple[bytes, tuple[ImageSlot, ...]]:
    """The tensors' bytes for a message of their own (for outputs too small for a segment)."""
    slots, total = layout(tensors)
    buffer = numpy.empty(total, dtype=numpy.uint8)
    write_slots(buffer, slots, tensors)
    return buffer.tobytes(), slots


def write_slots(
    buffer: numpy.ndarray[Any, numpy.dtype[numpy.uint8]],
    slots: Sequence[ImageSlot],
    tensors: Sequence[tuple[str, str, torch.Tensor]],
) -> None:
    for slot, (_, _, tensor) in zip(slots, tensors, strict=True):
        source = tensor.detach().to("cpu").contiguous()
        numpy.copyto(buffer[slot.offset : slot.offset + slot.nbytes], _as_bytes(source))


def read_slots(
    buffer: numpy.ndarray[Any, numpy.dtype[numpy.uint8]],
    slots: Sequence[ImageSlot],
) -> dict[str, dict[str, torch.Tensor]]:
    """``{field: {request id: tensor}}``, each tensor a copy that owns its memory."""
    fields: dict[str, dict[str, torch.Tensor]] = {}
    for slot in slots:
        tensor = torch.empty(slot.shape, dtype=_dtype(slot.dtype))
        numpy.copyto(_as_bytes(tensor), buffer[slot.offset : slot.offset + slot.nbytes])
        fields.setdefault(slot.field, {})[slot.request_id] = tensor
    return fields


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _as_bytes(tensor: torch.Tensor) -> numpy.ndarray[Any, numpy.dtype[numpy.uint8]]:
    """The bytes of a contiguous CPU tensor, as a numpy view.

    Copies go through numpy (one single-threaded memcpy that releases the
    GIL): torch's parallel copy of a few MB stalls for milliseconds when a
    core it waits for is busy, as it is while a worker computes.
    """
    array: numpy.ndarray[Any, numpy.dtype[numpy.uint8]] = (
        tensor.reshape(-1).view(torch.uint8).numpy()
    )
    return array


def _reserve(fd: int, size: int) -> None:
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
