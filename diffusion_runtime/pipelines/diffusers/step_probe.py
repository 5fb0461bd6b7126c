"""Whether one ``scheduler.step`` over stacked requests equals each request's own step.

Every request has its own copy of the pipeline's scheduler. Requests at the
same step of the same schedule can share one ``step`` call on their stacked
latents only when the scheduler keeps no per-sample history between steps
(DPM-Solver, UniPC, DEIS, PNDM keep past model outputs; Heun and KDPM2 keep the
first half of their step) and treats each row on its own, drawing any noise
per row from that row's generator (diffusers' ``randn_tensor`` does, given a
list of generators). That is checked, not assumed: :func:`steps_stack_exactly`
runs a short schedule on copies of the scheduler, row by row and stacked, and
requires bit-identical results and no state change but scalar counters.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

#: Rows and steps of the check; its latents are small, since no scheduler step depends on the size.
_ROWS = 3
_STEPS = 4
_ROW_SHAPE = (4, 8, 8)
_SCALARS = (type(None), bool, int, float)


def scalar_state(scheduler: Any) -> dict[str, object]:
    """The scheduler's attributes that hold a scalar (step counters, flags)."""
    return {name: value for name, value in vars(scheduler).items() if isinstance(value, _SCALARS)}


def steps_stack_exactly(template: Any, min_steps: int = 1) -> bool:
    """True when stepping stacked rows through one copy of ``template`` equals stepping each
    row through its own copy, bit for bit, over a whole schedule, and a step changes only
    scalar attributes (the same on every copy, so they can be copied from one to the others).
    """
    try:
        return _check(template, max(_STEPS, min_steps))
    except Exception:
        return False


def _check(template: Any, steps: int) -> bool:
    alone = [copy.deepcopy(template) for _ in range(_ROWS)]
    stacked = copy.deepcopy(template)
    for scheduler in (*alone, stacked):
        scheduler.set_timesteps(steps)
    accepted = inspect.signature(template.step).parameters
    draws = torch.Generator().manual_seed(0)
    seeds = range(1, _ROWS + 1)
    alone_generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    stacked_generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    eta = {"eta": 0.5} if "eta" in accepted else {}
    takes_generator = "generator" in accepted
    samples = torch.randn((_ROWS, *_ROW_SHAPE), generator=draws)
    for t in stacked.timesteps:
        model_output = torch.randn(samples.shape, generator=draws)
        before = [copy.deepcopy(vars(scheduler)) for scheduler in alone]
        rows = []
        for i, scheduler in enumerate(alone):
            scaled = scheduler.scale_model_input(samples[i : i + 1], t)
            alone_kwargs = {"generator": alone_generators[i]} if takes_generator else {}
            step = scheduler.step(
                model_output[i : i + 1], t, samples[i : i + 1], **eta, **alone_kwargs
            )
            rows.append((scaled, step))
        scaled = stacked.scale_model_input(samples, t)
        kwargs: dict[str, Any] = {"generator": stacked_generators} if takes_generator else {}
        result = stacked.step(model_output, t, samples, **eta, **kwargs)
        if not torch.equal(torch.cat([row[0] for row in rows]), scaled):
            return False
        for field in ("prev_sample", "pred_original_sample"):
            parts = [getattr(row[1], field, None) for row in rows]
            whole = getattr(result, field, None)
            if whole is None and all(part is None for part in parts):
                continue
            if whole is None or any(part is None for part in parts):
                return False
            if not torch.equal(torch.cat([part for part in parts if part is not None]), whole):
                return False
        expected = scalar_state(stacked)
        for scheduler, state in zip(alone, before, strict=True):
            if not _only_scalars_changed(state, vars(scheduler)):
                return False
            if scalar_state(scheduler) != expected:
                return False
        samples = result.prev_sample
    return True


def _only_scalars_changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    if before.keys() != after.keys():
        return False
    for name, old in before.items():
        new = after[name]
        if isinstance(old, _SCALARS) and isinstance(new, _SCALARS):
            continue
        if not _same(old, new):
            return False
    return True


def _same(old: object, new: object) -> bool:
    """Whether a non-scalar attribute kept its value (tensors by content, containers deeply)."""
    if old is new:
        return True
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return old.shape == new.shape and old.dtype == new.dtype and torch.equal(old, new)
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_same(old[k], new[k]) for k in old)
    if isinstance(old, _SCALARS) or isinstance(new, _SCALARS):
        return False
    try:
        return bool(old == new)
    except Exception:
        return False
