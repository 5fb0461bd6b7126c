"""The scheduler's record of one admitted request."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any

from diffusion_runtime.fsm import RequestLifecycle
from diffusion_runtime.sampling_params import SamplingParams


class Request(RequestLifecycle):
    """An admitted request: identity, input, lifecycle state, timings and progress.

    In step mode, ``step_index`` of ``num_steps`` is the progress the runner
    reported; a preempted request keeps it and resumes there. ``deadline`` is
    the monotonic time by which it should finish (``None``: no deadline), and
    ``order`` its place in admission order (the tie-break of every policy).
    Outputs never travel on this object: the core builds them as values from
    what each step decided. ``stage_seconds`` and ``peak_memory_bytes`` sum up
    what its waves cost (:meth:`charge`), for its final output's metrics.
    """

    __slots__ = (
        "arrival_time",
        "batch_key",
        "cached_steps",
        "deadline",
        "finished_time",
        "model_evaluations",
        "num_steps",
        "order",
        "params",
        "peak_memory_bytes",
        "prompt",
        "scheduled_time",
        "seed",
        "stage_seconds",
        "step_index",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        seed: int,
        batch_key: Hashable,
        arrival_time: float | None = None,
    ) -> None:
        super().__init__(request_id)
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.batch_key = batch_key
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        deadline_s = params.deadline_s
        self.deadline = None if deadline_s is None else self.arrival_time + deadline_s
        self.order = 0
        self.scheduled_time: float | None = None
        self.finished_time: float | None = None
        self.step_index = 0
        self.num_steps: int | None = None
        self.stage_seconds: dict[str, float] = {}
        self.peak_memory_bytes: int | None = None
        self.model_evaluations = 0
        self.cached_steps = 0

    def charge(
        self,
        phases: Mapping[str, float],
        transfer_s: float,
        peak_memory_bytes: int | None,
        steps: tuple[int, int] = (0, 0),
    ) -> None:
        """Add one wave's cost: its phases' seconds on the worker, the seconds its
        inputs and results took between core and worker, its memory peak, and
        its steps (model evaluations, cached steps)."""
        spent = self.stage_seconds
        for phase, seconds in phases.items():
            spent[phase] = spent.get(phase, 0.0) + seconds
        spent["transfer"] = spent.get("transfer", 0.0) + transfer_s
        if peak_memory_bytes is not None:
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0, peak_memory_bytes)
        self.model_evaluations += steps[0]
        self.cached_steps += steps[1]

    @property
    def remaining_steps(self) -> int:
        """Denoising steps still to run (all of them before the first step)."""
        total = self.params.num_inference_steps if self.num_steps is None else self.num_steps
        return total - self.step_index
