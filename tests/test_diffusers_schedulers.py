"""The lifecycle harness over the diffusers adapter, with every scheduler it drives from config.

Each scheduler ``StableDiffusionPipeline`` declares compatible is plugged into
the tiny random-weight pipeline (``diffusers_models``) and run through the
pytest plugin's ``lifecycle_harness``: request mode, and step mode under the
preemptive ``priority`` policy (the harness's urgent-work rule preempts), with
``rows_per_call`` so that every completed output must equal the same request
run alone, bit for bit, and every request must leave nothing held.

The default part runs a few examples per scheduler; ``pytest -m slow
tests/test_diffusers_schedulers.py`` runs many more. docs/diffusers.md has the
table these tests back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from conftest import factory_of
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from diffusion_runtime import EngineConfig
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.pipelines.protocols import PipelineRequest, forward_by_steps
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.testing.core_harness import core_lifecycle_machine
from diffusion_runtime.testing.strategies import sampling_params

pytestmark = [
    # Raised inside diffusers' sigma schedulers under numpy 2 (not by the runtime).
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
    # EDMEulerScheduler.from_config ignores the DDIM config keys it does not know.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
CPU = torch.device("cpu")

#: ``StableDiffusionPipeline``'s compatible schedulers (diffusers' ``KarrasDiffusionSchedulers``).
SCHEDULERS = (
    "DDIMScheduler",
    "DDPMScheduler",
    "PNDMScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "DPMSolverSinglestepScheduler",
    "DPMSolverSDEScheduler",
    "UniPCMultistepScheduler",
    "HeunDiscreteScheduler",
    "LMSDiscreteScheduler",
    "KDPM2DiscreteScheduler",
    "KDPM2AncestralDiscreteScheduler",
    "DEISMultistepScheduler",
    "EDMEulerScheduler",
)

#: Schedulers whose ``timesteps`` are longer than ``num_inference_steps`` (second-order
#: schedulers call the denoiser twice per step, PNDM adds Runge-Kutta warm-up calls):
#: in step mode the adapter runs one engine step per timestep, and the auditor's INV-009
#: (a request runs exactly the steps it asked for) flags every such request.
MORE_TIMESTEPS_THAN_STEPS = frozenset(
    {
        "HeunDiscreteScheduler",
        "KDPM2DiscreteScheduler",
        "KDPM2AncestralDiscreteScheduler",
        "DPMSolverSDEScheduler",
        "PNDMScheduler",
    }
)
STEP_MODE_SCHEDULERS = tuple(name for name in SCHEDULERS if name not in MORE_TIMESTEPS_THAN_STEPS)

PROMPTS = st.sampled_from(["a cat", "dog", {"prompt": "x", "negative_prompt": "y"}])


@pytest.fixture(scope="module")
def stable_diffusion(models: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return models.stable_diffusion_pipeline(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def with_scheduler(models: Any, stable_diffusion: Any) -> Callable[[str], Any]:
    def build(name: str) -> Any:
        if name == "DPMSolverSDEScheduler":
            pytest.importorskip("torchsde")
        return models.with_scheduler(stable_diffusion, name)

    return build


def engine_config(pipe: Any, mode: str) -> Callable[[], EngineConfig]:
    """A config factory: a fresh adapter per engine (closing an engine closes its pipeline).

    Step mode runs under the preemptive ``priority`` policy with a host-memory
    budget of about two states, so preempted requests resume both from the
    offloader and from where they were.
    """

    def config() -> EngineConfig:
        return EngineConfig(
            pipeline=factory_of(DiffusersPipeline(pipe, rows_per_call=8)),
            device="cpu",
            max_num_seqs=3,
            execution_mode=mode,
            scheduling_policy="priority",
            preempted_offload_bytes=8 * 2**10 if mode == "step" else 0,
            warmup=False,
        )

    return config


def request_params(pipe: Any) -> st.SearchStrategy[SamplingParams]:
    """Cheap requests from the scheduler's fewest steps, with and without guidance."""
    fewest = DiffusersPipeline(pipe).family.min_inference_steps
    return sampling_params(steps=(fewest, fewest + 2), guidance=[1.0, 3.0])


def run_harness(
    harness: Callable[..., None], pipe: Any, mode: str, max_examples: int, steps: int
) -> None:
    harness(
        engine_config(pipe, mode),
        prompts=PROMPTS,
        params=request_params(pipe),
        max_examples=max_examples,
        steps=steps,
        one_evaluation_per_step=type(pipe.scheduler).__name__ not in MORE_TIMESTEPS_THAN_STEPS,
    )


# -- the default part: a few examples per scheduler and mode ------------------------------


@pytest.mark.parametrize("name", SCHEDULERS)
def test_request_mode_keeps_every_output_equal_to_the_request_alone(
    lifecycle_harness: Callable[..., None], with_scheduler: Callable[[str], Any], name: str
) -> None:
    run_harness(lifecycle_harness, with_scheduler(name), "request", max_examples=2, steps=6)


@pytest.mark.parametrize("name", STEP_MODE_SCHEDULERS)
def test_step_mode_with_preemption_keeps_every_output_equal_to_the_request_alone(
    lifecycle_harness: Callable[..., None], with_scheduler: Callable[[str], Any], name: str
) -> None:
    run_harness(lifecycle_harness, with_scheduler(name), "step", max_examples=3, steps=8)


def test_a_preempted_multistep_scheduler_resumes_with_its_history(
    with_scheduler: Callable[[str], Any],
) -> None:
    """DPM-Solver++ keeps the last model outputs in the request's own scheduler: the
    harness preempts and resumes requests, and each still equals its run alone."""
    pipe = with_scheduler("DPMSolverMultistepScheduler")
    machine = core_lifecycle_machine(
        engine_config(pipe, "step"), prompts=PROMPTS, params=request_params(pipe)
    )
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=5, stateful_step_count=8, deadline=None, derandomize=True),
    )
    assert machine.reach.counts["path: a preempted request completed as the oracle"] >= 1


def test_the_sde_scheduler_draws_its_noise_from_the_request_generator(
    with_scheduler: Callable[[str], Any],
) -> None:
    """diffusers seeds DPMSolverSDEScheduler's Brownian tree from torch's global RNG;
    the adapter seeds it from the request's generator, so a seed gives one image."""
    adapter = DiffusersPipeline(with_scheduler("DPMSolverSDEScheduler"))
    params = SamplingParams(num_inference_steps=3, seed=5)

    def alone(global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        request = PipelineRequest("a", "a cat", params, 5, CPU)
        return forward_by_steps(adapter, [request])["a"]

    first = alone(0)
    assert torch.equal(first, alone(1))
    other = forward_by_steps(adapter, [PipelineRequest("b", "a cat", params, 6, CPU)])["b"]
    assert not torch.equal(first, other)


@pytest.mark.parametrize("name", sorted(MORE_TIMESTEPS_THAN_STEPS))
def test_these_schedulers_run_more_denoiser_steps_than_the_request_asked_for(
    with_scheduler: Callable[[str], Any], name: str
) -> None:
    """Why they are left out of the step-mode harness: a request of N steps runs
    ``len(scheduler.timesteps) > N`` engine steps, which INV-009 reports."""
    adapter = DiffusersPipeline(with_scheduler(name))
    steps = adapter.family.min_inference_steps + 1  # one step is one timestep for all of them
    request = PipelineRequest(
        "a", "a cat", SamplingParams(num_inference_steps=steps, seed=0), 0, CPU
    )
    assert len(adapter.prepare_encode(request).timesteps) > steps


# -- the thorough part --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the suite's 300 s is less than one scheduler's thorough run
@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("name", SCHEDULERS)
def test_thorough_run_of_every_scheduler(
    lifecycle_harness: Callable[..., None],
    with_scheduler: Callable[[str], Any],
    name: str,
    mode: str,
) -> None:
    pipe = with_scheduler(name)
    if mode == "step" and name in MORE_TIMESTEPS_THAN_STEPS:
        with pytest.raises(AssertionError, match="INV-009"):
            run_harness(lifecycle_harness, pipe, mode, max_examples=5, steps=8)
        return
    run_harness(lifecycle_harness, pipe, mode, max_examples=10, steps=10)
