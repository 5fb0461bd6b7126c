"""What callers receive for a request."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from diffusion_runtime.fsm import RequestStatus

if TYPE_CHECKING:
    from PIL import Image


@attrs.frozen(slots=True)
class RequestMetrics:
    """Seconds spent waiting, executing, and in total (admission to final output)."""

    queue_time_s: float
    execution_time_s: float
    total_time_s: float


@attrs.frozen(slots=True)
class RequestOutput:
    """One output of one request.

    ``finished`` is False only for intermediate outputs of a streamed request.
    ``images`` holds CPU float tensors ``(C, H, W)`` in ``[0, 1]``; it is empty
    unless the request completed (or, for intermediate outputs, sent a preview).
    ``error`` explains an aborted or failed request.
    """

    request_id: str
    status: RequestStatus
    finished: bool
    images: list[torch.Tensor]
    seed: int
    error: str | None = None
    metrics: RequestMetrics | None = None

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.FINISHED_COMPLETED

    def pil_images(self) -> list[Image.Image]:
        """The images as PIL images (8-bit, RGB or grayscale)."""
        from PIL import Image

        result = []
        for image in self.images:
            array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            mode = "L" if array.shape[2] == 1 else "RGB"
            result.append(Image.fromarray(array[:, :, 0] if mode == "L" else array, mode=mode))
        return result
