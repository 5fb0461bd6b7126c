"""Custom ``timesteps`` and ``sigmas``: which a diffusers scheduler takes, and setting them.

diffusers' pipelines hand a caller's ``timesteps=`` or ``sigmas=`` to
``scheduler.set_timesteps`` after checking, with ``inspect``, that its
signature has that parameter (``retrieve_timesteps``). The adapter does the
same, and at admission tries the request's schedule on a copy of the
scheduler, so a schedule the scheduler rejects (out of its training range,
in the wrong order...) is refused by field before the request costs anything.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.sampling_params import SamplingParams

#: The :class:`SamplingParams` fields that carry a custom schedule.
SCHEDULE_FIELDS = ("timesteps", "sigmas")


def schedules_taken(scheduler: Any) -> frozenset[str]:
    """The custom schedules ``scheduler.set_timesteps`` accepts as keyword arguments."""
    accepted = inspect.signature(scheduler.set_timesteps).parameters
    return frozenset(name for name in SCHEDULE_FIELDS if name in accepted)


def set_schedule(scheduler: Any, params: SamplingParams, device: torch.device | None) -> None:
    """Set the request's schedule on its own scheduler, as diffusers' pipelines do:
    ``set_timesteps(timesteps=...)`` or ``(sigmas=...)`` for a custom one, else the
    step count."""
    schedule = params.custom_schedule
    if schedule is None:
        scheduler.set_timesteps(params.num_inference_steps, device=device)
        return
    field, values = schedule
    scheduler.set_timesteps(device=device, **{field: list(values)})


def check_schedule(template: Any, params: SamplingParams, owner: str) -> None:
    """Refuse, naming the field, a custom schedule the scheduler does not take or rejects."""
    schedule = params.custom_schedule
    if schedule is None:
        return
    field, values = schedule
    name = type(template).__name__
    if field not in schedules_taken(template):
        rule = f"needs a scheduler whose set_timesteps takes {field} ({name} does not)"
        raise InvalidFieldError(owner, field, rule, values)
    probe = copy.deepcopy(template)
    try:
        set_schedule(probe, params, None)
    except Exception as exc:
        raise InvalidFieldError(owner, field, f"rejected by {name}: {exc}", values) from None
    if len(probe.timesteps) == 0:
        raise InvalidFieldError(owner, field, f"gives {name} no steps", values)
