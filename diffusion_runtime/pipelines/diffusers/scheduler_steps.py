"""The fewest inference steps a diffusers scheduler can run.

Most schedulers run from one step, but not all: ``PNDMScheduler`` with its
Runge-Kutta warm-up (``skip_prk_steps=False``, the default) needs at least
``pndm_order`` (4) steps, and ``set_timesteps`` fails below that. diffusers
publishes no such minimum, so it is found by trying step counts on a copy.
"""

from __future__ import annotations

import copy
from typing import Any

from diffusion_runtime.errors import DiffusionRuntimeError

#: The step counts tried, from 1; a scheduler that accepts none of them is refused.
MAX_PROBED_STEPS = 64


def minimum_inference_steps(scheduler: Any) -> int:
    """The smallest step count ``scheduler.set_timesteps`` accepts (on a copy)."""
    failure: Exception | None = None
    for steps in range(1, MAX_PROBED_STEPS + 1):
        probe = copy.deepcopy(scheduler)
        try:
            probe.set_timesteps(steps)
        except Exception as exc:
            failure = exc
            continue
        return steps
    raise DiffusionRuntimeError(
        f"{type(scheduler).__name__}.set_timesteps failed for every step count "
        f"from 1 to {MAX_PROBED_STEPS}: {failure!r}"
    )
