"""The digits pipeline's per-request TeaCache decisions (``docs/caching.md``).

The input signal is the request's latents, the model's image input: the
timestep and label inputs follow a fixed schedule, so the latents are what can
move a little or a lot between two steps. Each decision reads only its own
request's tensors, so a request skips the same steps whatever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_runtime.pipelines.protocols import StepRequestState
from diffusion_runtime.pipelines.step_cache import TeaCacheState


def reused_predictions(states: Sequence[StepRequestState]) -> dict[int, torch.Tensor]:
    """Decide this step for every state with a cache: ``id(state)`` -> the model
    output it reuses, for those that skip the model (marked ``step_cached``)."""
    reused: dict[int, torch.Tensor] = {}
    for state in states:
        cache: TeaCacheState | None = state.step_cache
        if cache is None:
            continue
        # A copy: the latents may be a view of a batch's stacked tensor.
        if cache.reuses(state.latents.clone(), state.step_index, state.num_steps):
            assert cache.prediction is not None
            state.step_cached = True
            reused[id(state)] = cache.prediction
    return reused


def remember_predictions(
    states: Sequence[StepRequestState], predictions: Sequence[torch.Tensor]
) -> None:
    """Keep each computed model output in its request's cache (a copy it owns)."""
    for state, prediction in zip(states, predictions, strict=True):
        cache: TeaCacheState | None = state.step_cache
        if cache is not None and not state.step_cached:
            cache.prediction = prediction.clone()
