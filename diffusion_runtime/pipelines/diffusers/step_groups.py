"""Requests that share a scheduler step: same schedule, same step, stacked latents.

A :class:`StepGroup` holds requests whose scheduler copies are interchangeable
for the next step (same template, step count or custom schedule, step index and scalar state,
same latent row shape, guidance and step arguments), with their latents in
one tensor that lives as long as the running set is unchanged. The adapter
calls the denoiser once for all groups and each group's lead scheduler once
for all its rows; the other members' schedulers get the lead's scalar state
(step counters), which is what their own step would have set.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.pipelines.diffusers.family import Encoded
from diffusion_runtime.pipelines.diffusers.step_probe import scalar_state
from diffusion_runtime.pipelines.parallel import RowBlock
from diffusion_runtime.pipelines.protocols import StepRequestState


@attrs.define(eq=False)
class StepGroup:
    """Requests stepped as one stack. ``rows`` are their conditioning rows for the stack
    (under guidance every member's first half, then every member's second half, the
    order diffusers itself stacks a batch in)."""

    states: list[StepRequestState]
    latents: torch.Tensor
    rows: torch.Tensor | None
    guidance: float | None
    step_kwargs: dict[str, Any]

    @property
    def lead(self) -> StepRequestState:
        return self.states[0]

    @property
    def wants_log_probs(self) -> bool:
        """Whether a member asked for its steps' log-probabilities."""
        return any(state.request.params.return_trajectory == "full" for state in self.states)

    def sizes(self) -> list[int]:
        return [len(state.latents) for state in self.states]

    def advance(
        self, latents: torch.Tensor, x0: torch.Tensor | None, log_prob: torch.Tensor | None
    ) -> None:
        """Record a step: new latents, clean estimate and log-probability (one per row, or
        ``None``) for every member, counters synced."""
        self.latents = latents
        states = self.states
        if len(states) == 1:
            state = states[0]
            state.latents = latents
            state.conditioning.x0 = x0
            state.step_log_prob = log_prob
            state.step_index += 1
            return
        counters = scalar_state(self.lead.scheduler)
        sizes = self.sizes()
        x0_parts = _split_or_nones(x0, sizes)
        log_probs = _split_or_nones(log_prob, sizes)
        for state, part, x0_part, log_prob_part in zip(
            states, torch.split(latents, sizes), x0_parts, log_probs, strict=True
        ):
            state.latents = part
            state.conditioning.x0 = x0_part
            state.step_log_prob = log_prob_part
            state.step_index += 1
            vars(state.scheduler).update(counters)


def group_blocks(groups: Sequence[StepGroup]) -> list[RowBlock]:
    """The row blocks of the denoiser's stacked input: per guided group, its two
    halves (the branches, in the family's order); an unguided group by request."""
    blocks: list[RowBlock] = []
    for group in groups:
        if group.guidance is not None:
            blocks += [(len(group.latents), 0), (len(group.latents), 1)]
        else:
            blocks += [(len(state.latents), None) for state in group.states]
    return blocks


def _split_or_nones(tensor: torch.Tensor | None, sizes: list[int]) -> Sequence[torch.Tensor | None]:
    """``tensor`` split into parts of ``sizes`` rows, or a ``None`` per part."""
    return [None] * len(sizes) if tensor is None else torch.split(tensor, sizes)


def plan_groups(states: Sequence[StepRequestState], stackable: bool) -> list[StepGroup]:
    """``states`` grouped for stacked steps (each alone unless ``stackable``), first seen first."""
    members: dict[Hashable, list[StepRequestState]] = {}
    for state in states:
        members.setdefault(_group_key(state) if stackable else id(state), []).append(state)
    return [_group(group) for group in members.values()]


def _group_key(state: StepRequestState) -> Hashable:
    encoded: Encoded = state.conditioning
    kwargs = encoded.step_kwargs
    if "generator" in kwargs and len(state.latents) > 1:
        # A list of generators draws one row per generator; N rows from one generator
        # are one draw of N rows, which only a step of its own repeats.
        return id(state)
    latents = state.latents
    params = state.request.params
    return (
        params.num_inference_steps,
        params.custom_schedule,
        state.step_index,
        tuple(latents.shape[1:]),
        latents.dtype,
        encoded.guidance,
        tuple((name, value) for name, value in kwargs.items() if name != "generator"),
        tuple(scalar_state(state.scheduler).items()),
    )


def _group(states: list[StepRequestState]) -> StepGroup:
    lead: Encoded = states[0].conditioning
    if len(states) == 1:
        latents, rows, kwargs = states[0].latents, lead.rows, lead.step_kwargs
    else:
        latents = torch.cat([state.latents for state in states])
        rows = _stack_rows([state.conditioning for state in states], lead.guidance is not None)
        kwargs = dict(lead.step_kwargs)
        if "generator" in kwargs:
            kwargs["generator"] = [state.request.generator for state in states]
    return StepGroup(states, latents, rows, lead.guidance, kwargs)


def _stack_rows(encoded: list[Encoded], guided: bool) -> torch.Tensor | None:
    parts = [item.rows for item in encoded]
    if any(part is None for part in parts):
        return None
    rows = [part for part in parts if part is not None]
    if not guided:
        return torch.cat(rows)
    halves = [part.chunk(2) for part in rows]
    return torch.cat([half[0] for half in halves] + [half[1] for half in halves])
