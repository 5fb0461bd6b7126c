"""Copies a wave's images and previews to host memory, off the compute stream.

On CUDA with overlap on, each tensor is copied into pinned host memory by a
non-blocking copy on a side stream that waits for the compute stream; the
wave's result is returned at once, and its :class:`CudaCopyFence` (an event
recorded after the copies) says when the images are there. The device
tensors are marked as used by the side stream, so the caching allocator does
not hand their memory out again before the copy has read them, even when the
runner has already dropped the request's state.

On the CPU (and with overlap off) the copy is done when :meth:`to_host`
returns and the fence is :data:`~diffusion_runtime.contracts.READY`: the two
phases collapse into one, through the same calls.
"""

from __future__ import annotations

import torch

from diffusion_runtime.contracts import READY, OutputFence


class CudaCopyFence(OutputFence):
    """Ready when the CUDA event recorded after a wave's copies has completed."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def is_ready(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()


class HostCopier:
    """Makes host copies of output tensors for one device; one :meth:`fence` per wave."""

    def __init__(self, device: torch.device, *, overlap: bool = True) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and overlap:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._copies_in_flight = False

    @property
    def overlaps(self) -> bool:
        """Whether copies run on a side stream (CUDA with overlap on)."""
        return self._stream is not None

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor that owns its memory and holds ``tensor``'s values once the
        wave's fence is ready (at once on the CPU)."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.device.type == "cpu":
            return _owned(tensor)
        stream = self._stream
        if stream is None or tensor.device != self.device:
            return tensor.to("cpu")
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)
        self._copies_in_flight = True
        return host

    def fence(self) -> OutputFence:
        """The fence of every copy started since the last call."""
        if not self._copies_in_flight:
            return READY
        assert self._stream is not None
        self._copies_in_flight = False
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return CudaCopyFence(event)


def _owned(images: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its memory: a slice of a batch must not keep the batch alive."""
    if images._base is not None and (
        images.untyped_storage().nbytes() != images.numel() * images.element_size()
    ):
        return images.clone()
    return images
