"""Bugs in grouped requests (a parent over a child request per prompt,
:mod:`diffusion_runtime.request_groups`), which the front harness over the
in-process engine must catch with its batch rules: the engine's grouped requests
and the stage's batch requests share one parent, so each bug is in both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusion_runtime import request_groups
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput, Trajectory
from diffusion_runtime.request_groups import CHILD_END_TRIGGERS, RequestGroup
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute


def merge_drops_the_last_child() -> Patch:
    def make(original: Any) -> Any:
        def push(self: RequestGroup, output: RequestOutput) -> None:
            if not output.finished:
                return
            index = self._index[output.request_id]
            self._ended += 1
            if self.state is RequestStatus.RUNNING:
                trigger = CHILD_END_TRIGGERS[output.status]
                if output.status is not RequestStatus.FINISHED_COMPLETED:
                    self._fire(trigger, f"prompt {index}: {output.error or output.status.value}")
                elif self._ended == len(self.child_ids):
                    self._fire(trigger, None)
            self._deliver_when_done()
            self._finals[index] = output  # "recorded once the parent has decided"

        return push

    return replace_attribute(RequestGroup, "push", make)


def trajectories_stacked_along_steps() -> Patch:
    def make(original: Any) -> Any:
        def merge(trajectories: Sequence[Trajectory | None]) -> Trajectory | None:
            merged: Trajectory | None = original(trajectories)
            known = [t for t in trajectories if t is not None]
            if merged is None or len(known) < 2:
                return merged
            # "torch.cat joins the children's latents" (along its default dimension)
            latents = torch.cat([t.latents for t in known])
            return Trajectory(latents, merged.timesteps, merged.log_probs, merged.log_prob_steps)

        return merge

    return replace_attribute(request_groups, "merge_trajectories", make)


#: Run by the front harness over a DiffusionEngine (its batch rules); the last
#: with output options drawn (``outputs-front``).
GROUP_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="group-merge-drops-last-child", mode="request", target="front",
             bug="a parent's merge leaves out the child whose end completed it (its output is "
                 "recorded after the parent is delivered)",
             patch=merge_drops_the_last_child),
    Mutation(name="group-trajectories-along-steps", mode="request", target="outputs-front",
             bug="a parent's trajectory joins its children's latents along the steps, not "
                 "the images",
             patch=trajectories_stacked_along_steps),
)  # fmt: skip
