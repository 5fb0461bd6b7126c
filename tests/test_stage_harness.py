"""The lifecycle harness pointed at the stage (``target="stage"``): a StageClient and
its stage process, held between steps, killed, closed with readers waiting, and
audited from the stage's trace once it has shut down.

Each example starts a stage process (1-5 s on two shared cores), so the default
run keeps to a few examples; ``tests/test_mutations.py`` runs more (slow) and
proves the stage harness catches the stage mutations.
"""

from __future__ import annotations

from collections.abc import Iterator

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings

from diffusion_runtime import EngineConfig, InvalidFieldError
from diffusion_runtime.scheduler.step_scheduler import StepScheduler
from diffusion_runtime.testing import lifecycle_test_case
from diffusion_runtime.testing.harness import lifecycle_machine
from diffusion_runtime.testing.leaks import Leftovers
from diffusion_runtime.testing.stage_front import StageFront
from diffusion_runtime.testing.strategies import sampling_params


def stage_config() -> EngineConfig:
    return EngineConfig(
        pipeline="testing-faults",
        device="cpu",
        max_num_seqs=3,
        execution_mode="step",
        warmup=False,  # a stage starts per example
        intra_op_threads=1,
    )


TestStageLifecycle = lifecycle_test_case(
    stage_config,
    target="stage",
    prompts=st.sampled_from(["cat", "dog", 7]),
    failing_prompts=st.sampled_from(["fail", "bad-step"]),
    params=sampling_params(steps=(2, 4), outputs=(1, 2)),
    read_timeout_s=10.0,
    settings=settings(
        max_examples=3,
        stateful_step_count=12,
        deadline=None,
        derandomize=True,  # the same three examples on every run
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    ),
)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no stage process, thread or socket directory (the harness
    checks this after every example too)."""
    baseline = Leftovers.baseline()
    yield
    assert not baseline.since()


def test_an_unknown_target_is_refused_by_field() -> None:
    with pytest.raises(InvalidFieldError) as refused:
        lifecycle_test_case(stage_config, target="stages")
    assert refused.value.field == "target"
    assert "'core', 'front', 'stage'" in str(refused.value)


def test_the_engine_s_own_components_are_refused_for_the_stage() -> None:
    with pytest.raises(InvalidFieldError) as refused:
        lifecycle_machine(stage_config, front=StageFront, scheduler_cls=StepScheduler)
    assert refused.value.field == "scheduler_cls"
    assert "must be None" in refused.value.rule
