"""Bugs in what a request gets back besides images (latents, trajectories and their
log-probabilities), which the ``outputs`` target must catch: its oracle records each
trajectory itself, one step at a time, outside the runtime's recorder."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import attrs
import torch

from diffusion_runtime import core
from diffusion_runtime.contracts import RunnerOutput
from diffusion_runtime.executor.mp import segments
from diffusion_runtime.pipelines.protocols import StepRequestState
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute
from diffusion_runtime.trajectory import TrajectoryRecorder, TrajectoryTensors


def last_step_not_recorded() -> Patch:
    def make(original: Any) -> Any:
        def record_step(self: StepRequestState) -> None:
            if self.is_done:  # "the last latents are the output anyway"
                self.step_log_prob = None
                return
            original(self)

        return record_step

    return replace_attribute(StepRequestState, "record_step", make)


def log_prob_carried_over() -> Patch:
    def make(original: Any) -> Any:
        def record_step(self: StepRequestState) -> None:
            kept = self.step_log_prob
            original(self)
            # "keep the last log-prob at hand": a step that draws no noise reports the
            # one before it
            self.step_log_prob = kept

        return record_step

    return replace_attribute(StepRequestState, "record_step", make)


def trajectory_of_a_batch_mate() -> Patch:
    def make(original: Any) -> Any:
        def of(cls: Any, request: Request, result: RunnerOutput | None) -> Any:
            products = original.__func__(cls, request, result)
            if result is not None and len(result.trajectory_latents) > 1:
                # "the trajectories of one result are in request order": the first one
                first = next(iter(result.trajectory_latents))
                mate = SimpleNamespace(request_id=first, params=request.params)
                other = original.__func__(cls, mate, result)
                return cls(products.images, products.latents, other.trajectory)
            return products

        return classmethod(of)

    return replace_attribute(core._Products, "of", make)


def latents_delivered_as_images() -> Patch:
    def make(original: Any) -> Any:
        def of(cls: Any, request: Request, result: RunnerOutput | None) -> Any:
            products = original.__func__(cls, request, result)
            if products.latents is not None:  # "an output's tensor is its image_batch"
                return cls(products.latents, None, products.trajectory)
            return products

        return classmethod(of)

    return replace_attribute(core._Products, "of", make)


@contextlib.contextmanager
def costs_charged_after_commit() -> Iterator[None]:
    """ "Charge a wave's costs once its results are in": the requests that ended in
    the wave are gone from the running set by then, so their last wave is never
    counted (one that ran in a single wave reports no denoising at all)."""
    deferred: list[tuple[Any, ...]] = []

    def defer(original: Any) -> Any:
        def charge(self: core.EngineCore, *args: Any) -> None:
            deferred.append(args)

        return charge

    def commit_then_charge(original: Any) -> Any:
        def commit(self: core.EngineCore, *args: Any) -> None:
            original(self, *args)
            while deferred:
                charge_costs(self, *deferred.pop())

        return commit

    charge_costs = core.EngineCore.__dict__["_charge_costs"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(replace_attribute(core.EngineCore, "_charge_costs", defer))
        stack.enter_context(replace_attribute(core.EngineCore, "_commit", commit_then_charge))
        yield


def slots_read_at_the_image_dtype() -> Patch:
    def make(original: Any) -> Any:
        def read_slots(buffer: Any, slots: Any) -> dict[str, dict[str, Any]]:
            # "every slot holds an image": float32, whatever the slot says
            read: dict[str, dict[str, Any]] = original(
                buffer, [attrs.evolve(slot, dtype="float32") for slot in slots]
            )
            return read

        return read_slots

    return replace_attribute(segments, "read_slots", make)


def one_counter_for_streamed_parts() -> Patch:
    def make(original: Any) -> Any:
        def take_part(self: TrajectoryRecorder, timesteps: tuple[int, ...]) -> TrajectoryTensors:
            start = self.taken[0]
            # "one counter: each step records its latents and its log-prob together"
            self.taken = (len(self.latents), len(self.latents))
            new_log_probs = self.log_probs[start:]
            return TrajectoryTensors(
                torch.stack(self.latents[start:]),
                torch.stack(new_log_probs) if new_log_probs else None,
                timesteps[max(start - 1, 0) : len(self.latents) - 1],
                tuple(self.log_prob_steps[start:]),
            )

        return take_part

    return replace_attribute(TrajectoryRecorder, "take_part", make)


OUTPUT_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="trajectory-last-step-dropped", mode="step", target="outputs",
             bug="the runner does not record a request's last step in its trajectory",
             patch=last_step_not_recorded),
    Mutation(name="log-prob-carried-over", mode="step", target="outputs",
             bug="a step that draws no noise reports the previous step's log-probability",
             patch=log_prob_carried_over),
    Mutation(name="trajectory-of-a-batch-mate", mode="request", target="outputs",
             bug="a request's final output carries the first trajectory of its wave",
             patch=trajectory_of_a_batch_mate),
    Mutation(name="latents-as-images", mode="request", target="outputs",
             bug="a request that asked for latents gets them as its images",
             patch=latents_delivered_as_images),
    Mutation(name="costs-charged-after-commit", mode="request", target="core",
             bug="a wave's costs are charged after its results, missing the requests it ended",
             patch=costs_charged_after_commit),
    Mutation(name="mp-slots-read-as-images", mode="step", target="outputs-mp",
             bug="the core reads every tensor a worker sends at the images' dtype (float32)",
             patch=slots_read_at_the_image_dtype),
    Mutation(name="streamed-parts-share-one-counter", mode="step", target="outputs-streamed",
             bug="a streamed trajectory part counts its log-probs from where its latents start",
             patch=one_counter_for_streamed_parts),
)  # fmt: skip
