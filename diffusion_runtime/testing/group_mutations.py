"""Bugs in grouped requests (a parent over a child request per prompt,
:mod:`diffusion_runtime.request_groups`), which the front harness over the
in-process engine must catch with its batch rules: the engine's grouped requests
and the stage's batch requests share one parent, so each bug is in both."""

from __future__ import annotations

from typing import Any

from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
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


#: Run by the front harness over a DiffusionEngine (its batch rules).
GROUP_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="group-merge-drops-last-child", mode="request", target="front",
             bug="a parent's merge leaves out the child whose end completed it (its output is "
                 "recorded after the parent is delivered)",
             patch=merge_drops_the_last_child),
)  # fmt: skip
