"""What the adapter needs to know about a diffusers scheduler beyond its ``step``.

Most schedulers run from one step, but not all: ``PNDMScheduler`` with its
Runge-Kutta warm-up (``skip_prk_steps=False``, the default) needs at least
``pndm_order`` (4) steps, and ``set_timesteps`` fails below that. diffusers
publishes no such minimum, so it is found by trying step counts on a copy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

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


#: The largest seed ``BrownianTreeNoiseSampler`` draws itself (``torch.randint(0, 2**63 - 1)``).
_MAX_NOISE_SEED = 2**63 - 1


def seed_noise_sampler(scheduler: Any, generator: torch.Generator) -> None:
    """Seed a Brownian-tree noise sampler from the request's generator, not torch's global RNG.

    ``DPMSolverSDEScheduler`` (with ``noise_sampler_seed=None``, its default)
    builds its noise sampler at the first ``step`` from a seed drawn with
    ``torch.randint`` on the global RNG, and its ``step`` takes no generator:
    its images would depend on whatever else used the global RNG. A seed drawn
    here from the request's generator makes them depend on the request alone.
    A seed set in the scheduler's config is kept.
    """
    if hasattr(scheduler, "noise_sampler_seed") and scheduler.noise_sampler_seed is None:
        seed = torch.randint(0, _MAX_NOISE_SEED, (), generator=generator, device=generator.device)
        scheduler.noise_sampler_seed = int(seed.item())
