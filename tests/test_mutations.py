"""Proof by mutation: the harness fails on each deliberately broken runtime and
passes on the real one."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from conftest import engine_threads

from diffusion_runtime import EngineConfig
from diffusion_runtime.testing.harness import EngineLifecycleMachine, lifecycle_machine
from diffusion_runtime.testing.mutations import CATALOGUE, Mutation, hunt
from diffusion_runtime.testing.strategies import sampling_params

MAX_EXAMPLES = 150


def harness(mode: str) -> type[EngineLifecycleMachine]:
    machine = lifecycle_machine(
        lambda: EngineConfig(
            pipeline="testing-faults", device="cpu", max_num_seqs=3, execution_mode=mode
        ),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        # Step mode needs requests that stay running long enough to be aborted mid-flight.
        params=sampling_params(steps=(1, 3) if mode == "request" else (2, 6), outputs=(1, 2)),
    )
    machine.read_timeout_s = 3.0  # a hung stream fails the example instead of the suite
    return machine


def test_catalogue_is_large_and_named_uniquely() -> None:
    assert len(CATALOGUE) >= 12
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_real_runtime_passes(mode: str) -> None:
    assert hunt(None, harness(mode), max_examples=MAX_EXAMPLES) is None
    assert engine_threads() == []


@pytest.mark.parametrize("mutation", CATALOGUE, ids=lambda m: m.name)
def test_the_harness_catches(mutation: Mutation, record_property: object) -> None:
    examples = hunt(mutation, harness(mutation.mode), max_examples=MAX_EXAMPLES)
    assert examples is not None, f"the harness missed: {mutation.bug}"
    print(f"{mutation.name}: caught after {examples} example(s)")
    assert engine_threads() == []
