"""Bugs in per-request step caching (``docs/caching.md``), which the ``cache``
target must catch: with its identity check (a request's images equal the
oracle's, which runs it alone), or with its metrics check (model evaluations
and cached steps add up to the steps run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.contracts import RunnerOutput, WaveCosts
from diffusion_runtime.pipelines.diffusers import cached_denoiser
from diffusion_runtime.pipelines.digits import pipeline as digits_pipeline
from diffusion_runtime.pipelines.protocols import StepRequestState
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute


def decided_over_the_batch() -> Patch:
    def make(original: Any) -> Any:
        def reused(states: Sequence[StepRequestState]) -> dict[int, torch.Tensor]:
            cached = [state for state in states if state.step_cache is not None]
            # "one decision per step: the batch's requests move together"
            decided: dict[int, torch.Tensor] = original(cached[:1])
            for state in cached[1:]:
                cache = state.step_cache
                cache.signal = state.latents.clone()
                if decided and cache.prediction is not None:
                    state.step_cached = True
                    decided[id(state)] = cache.prediction
            return decided

        return reused

    return replace_attribute(digits_pipeline, "reused_predictions", make)


def reuses_a_batch_mates_prediction() -> Patch:
    def make(original: Any) -> Any:
        def reused(states: Sequence[StepRequestState]) -> dict[int, torch.Tensor]:
            decided: dict[int, torch.Tensor] = original(states)
            kept = [
                state.step_cache.prediction
                for state in states
                if state.step_cache is not None and state.step_cache.prediction is not None
            ]
            for key, own in decided.items():
                # "the batch's cached output" (the last kept one of the same shape)
                decided[key] = next(p for p in reversed(kept) if p.shape == own.shape)
            return decided

        return reused

    return replace_attribute(digits_pipeline, "reused_predictions", make)


def skipped_step_charged_to_the_model() -> Patch:
    def make(original: Any) -> Any:
        def count_steps(self: WaveCosts, request_id: str, evaluations: int, cached: int) -> None:
            # "a skipped row was in the batch, so it counts as evaluated"
            original(self, request_id, evaluations + cached, cached)

        return count_steps

    return replace_attribute(WaveCosts, "count_steps", make)


def first_block_decided_over_the_batch() -> Patch:
    def make(original: Any) -> Any:
        def skips(residuals: Sequence[tuple[StepRequestState, torch.Tensor]]) -> list[bool]:
            # "one decision per step: the batch's requests move together"
            decided: list[bool] = original(residuals[:1])
            lead = bool(decided and decided[0])
            for state, residual in residuals[1:]:
                kept = state.step_cache.later_residual
                decided.append(lead and kept is not None and kept.shape == residual.shape)
            return decided

        return skips

    return replace_attribute(cached_denoiser, "first_block_skips", make)


def step_counts_lost_crossing_processes() -> Patch:
    def make(original: Any) -> Any:
        def with_tensors(self: RunnerOutput, fields: Any) -> RunnerOutput:
            result: RunnerOutput = original(self, fields)
            if result.costs is None:
                return result
            # "the copy keeps the wave's times; the step counts are the worker's business"
            return attrs.evolve(result, costs=attrs.evolve(result.costs, steps={}))

        return with_tensors

    return replace_attribute(RunnerOutput, "with_tensors", make)


#: Run by the ``cache`` targets: the core over digits (or a tiny DiT) with a step cache.
CACHE_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="cache-decided-over-batch",
        mode="step",
        target="cache",
        bug="the step cache decides once for the whole batch, from its first request",
        patch=decided_over_the_batch,
    ),
    Mutation(
        name="cache-reuses-batch-mates-output",
        mode="request",
        target="cache",
        bug="a request that skips a step reuses a batch mate's cached model output",
        patch=reuses_a_batch_mates_prediction,
    ),
    Mutation(
        name="cache-first-block-decided-over-batch",
        mode="step",
        target="cache-dit",
        bug="the first-block cache decides once for the whole batch, from its first request",
        patch=first_block_decided_over_the_batch,
    ),
    Mutation(
        name="cache-counts-lost-across-processes",
        mode="step",
        target="cache-mp",
        bug="a wave's model evaluations and cached steps are dropped when its output "
        "comes back from the mp workers",
        patch=step_counts_lost_crossing_processes,
    ),
    Mutation(
        name="cache-skip-charged-as-evaluation",
        mode="step",
        target="cache",
        bug="a step that reused its cached output is still counted as a model evaluation",
        patch=skipped_step_charged_to_the_model,
    ),
)
