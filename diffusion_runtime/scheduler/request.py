"""The scheduler's record of one admitted request."""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import torch

from diffusion_runtime.fsm import RequestLifecycle
from diffusion_runtime.sampling_params import SamplingParams


class Request(RequestLifecycle):
    """An admitted request: identity, input, lifecycle state and timings.

    ``sink`` is where the engine delivers this request's outputs (``None`` once
    the consumer is gone). ``images`` holds the result between the runner's
    output and the terminal transition that delivers it. In step mode,
    ``step_index`` of ``num_steps`` is the progress the runner reported.
    """

    __slots__ = (
        "arrival_time",
        "batch_key",
        "finished_time",
        "images",
        "num_steps",
        "params",
        "prompt",
        "scheduled_time",
        "seed",
        "sink",
        "step_index",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        seed: int,
        batch_key: Hashable,
        sink: Any = None,
    ) -> None:
        super().__init__(request_id)
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.batch_key = batch_key
        self.sink = sink
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.finished_time: float | None = None
        self.images: torch.Tensor | None = None
        self.step_index = 0
        self.num_steps: int | None = None
