"""Telling a device fault (fatal for the executor) from an ordinary error."""

from __future__ import annotations

from diffusion_runtime.errors import DeviceFault

# Messages of errors after which a CUDA context is unusable.
_STICKY_MARKERS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "CUDA error: misaligned address",
    "CUDA error: an illegal instruction",
)


def is_sticky_device_fault(exc: BaseException) -> bool:
    """True for a :class:`DeviceFault` or an accelerator error that poisons the device.

    Out-of-memory is not sticky: the device stays usable, so it fails only the
    requests of its wave.
    """
    if isinstance(exc, DeviceFault):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(m in message for m in _STICKY_MARKERS)
