"""Small real pipelines for tests and benchmarks: deterministic, seeded, batch-independent.

They do real tensor work on the configured device, draw all randomness from
each request's own generator, and only use element-wise and spatial
operations, so a request's output is bit-identical alone or in any batch.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffusion_runtime.errors import DeviceFault
from diffusion_runtime.runner.protocols import PipelineRequest
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.validation import fail

MAX_SIZE = 256


class SeededNoisePipeline:
    """A toy denoiser: seeded noise pulled step by step toward a pattern set by the prompt.

    The output depends on the prompt, the seed, the step count and the
    guidance scale, and on nothing else.
    """

    supports_request_batch = True

    def __init__(
        self,
        device: torch.device | str = "cpu",
        size: int = 16,
        channels: int = 3,
        supports_request_batch: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.size = size
        self.channels = channels
        self.supports_request_batch = supports_request_batch

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        if not isinstance(prompt, (str, int)) or isinstance(prompt, bool):
            fail(self, "prompt", "must be a str or an int", prompt)
        for field in ("height", "width"):
            value = getattr(params, field)
            if value is not None and value > MAX_SIZE:
                fail(self, field, f"must be at most {MAX_SIZE}", value)

    def warmup_request(self) -> tuple[Any, SamplingParams]:
        return "warm-up", SamplingParams(num_inference_steps=1, seed=0)

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        params = batch[0].params
        height, width = params.height or self.size, params.width or self.size
        counts = [request.params.num_outputs_per_prompt for request in batch]
        noise = torch.cat(
            [
                torch.randn(
                    (n, self.channels, height, width), generator=r.generator, device=self.device
                )
                for r, n in zip(batch, counts, strict=True)
            ]
        )
        target = torch.cat(
            [self._pattern(r.prompt, n, height, width) for r, n in zip(batch, counts, strict=True)]
        )
        target = target * (1.0 + 0.1 * params.guidance_scale)
        x = noise
        steps = params.num_inference_steps
        for i in range(steps):
            x = x + (target - x) * (1.0 / (steps - i + 1))
            x = (x + x.roll(1, dims=-1) + x.roll(1, dims=-2)) / 3.0
        images = torch.sigmoid(x)
        return dict(zip([r.request_id for r in batch], torch.split(images, counts), strict=True))

    def _pattern(self, prompt: Any, count: int, height: int, width: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device).manual_seed(
            zlib.crc32(str(prompt).encode())
        )
        pattern = torch.randn(
            (1, self.channels, height, width), generator=generator, device=self.device
        )
        return pattern.expand(count, -1, -1, -1)


class FaultInjectingPipeline(SeededNoisePipeline):
    """:class:`SeededNoisePipeline` with faults chosen by words in the prompt.

    - ``"fail"``: the forward raises ``RuntimeError`` (fails its whole forward);
    - ``"missing"``: the forward omits this request's result;
    - ``"device-fault"``: the forward raises :class:`DeviceFault` (kills the executor);
    - ``"gate"``: the forward sets :attr:`gate_entered` and blocks until
      :attr:`gate_release` is set, so a test can act while a wave is running.
    """

    GATE_TIMEOUT_S = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate_entered = threading.Event()
        self.gate_release = threading.Event()
        self.forward_batches: list[list[str]] = []

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        prompts = [str(request.prompt) for request in batch]
        self.forward_batches.append([request.request_id for request in batch])
        if any("gate" in p for p in prompts):
            self.gate_entered.set()
            if not self.gate_release.wait(self.GATE_TIMEOUT_S):
                raise TimeoutError("the test never released the gate")
        if any("device-fault" in p for p in prompts):
            raise DeviceFault("injected device fault")
        if any("fail" in p for p in prompts):
            raise RuntimeError("injected failure")
        results = dict(super().forward(batch))
        for request, prompt in zip(batch, prompts, strict=True):
            if "missing" in prompt:
                del results[request.request_id]
        return results


class NullPipeline:
    """Does almost nothing: a 1x1 image per output. Measures the runtime's own cost."""

    supports_request_batch = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._blank = torch.zeros((1, 1, 1, 1), device=self.device)

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        blank = self._blank
        return {
            r.request_id: blank
            if r.params.num_outputs_per_prompt == 1
            else blank.expand(r.params.num_outputs_per_prompt, -1, -1, -1)
            for r in batch
        }
