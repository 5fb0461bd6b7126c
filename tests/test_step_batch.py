"""Batch-shaped steps: ``step_batch`` and ``post_decode_batch`` give each request what its own
per-request steps give it, bit for bit, for the digits pipeline and the diffusers adapter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from diffusion_runtime.pipelines.digits import DigitsPipeline
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepPipeline, StepRequestState
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline

# Raised inside diffusers' sigma schedulers under numpy 2 (not by the runtime).
pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:__array_wrap__ must accept:DeprecationWarning"),
]
CPU = torch.device("cpu")


def states_of(pipeline: StepPipeline, specs: Sequence[tuple[Any, SamplingParams]]) -> list[Any]:
    return [
        pipeline.prepare_encode(PipelineRequest(f"r{i}", prompt, params, 100 + i, CPU))
        for i, (prompt, params) in enumerate(specs)
    ]


def run_by_request(pipeline: Any, states: list[StepRequestState]) -> dict[str, torch.Tensor]:
    """The per-request path: ``denoise_step`` over the batch, then each request's own step."""
    images = {}
    while live := [state for state in states if not state.is_done]:
        for state, output in zip(live, pipeline.denoise_step(live), strict=True):
            pipeline.step_scheduler(state, output)
            if state.is_done:
                images[state.request_id] = pipeline.post_decode(state)
    return images


def run_batched(pipeline: Any, states: list[StepRequestState]) -> dict[str, torch.Tensor]:
    """The batch path: ``step_batch``, then ``post_decode_batch`` of those finishing together."""
    images = {}
    while live := [state for state in states if not state.is_done]:
        pipeline.step_batch(live)
        done = [state for state in live if state.is_done]
        if done:
            decoded = pipeline.post_decode_batch(done)
            images.update(zip([state.request_id for state in done], decoded, strict=True))
    return images


def assert_same_images(
    pipeline: Any, specs: Sequence[tuple[Any, SamplingParams]]
) -> dict[str, torch.Tensor]:
    by_request = run_by_request(pipeline, states_of(pipeline, specs))
    batched = run_batched(pipeline, states_of(pipeline, specs))
    assert by_request.keys() == batched.keys() == {f"r{i}" for i in range(len(specs))}
    for rid, images in by_request.items():
        assert torch.equal(images, batched[rid]), rid
    return batched


# -- digits -----------------------------------------------------------------------------


def test_digits_batched_steps_equal_per_request_steps_bit_for_bit() -> None:
    """Mixed step counts, guidance scales, output counts and sizes: several groups at once."""
    pipe = DigitsPipeline()
    specs = [
        (i % 10, SamplingParams(num_inference_steps=steps, guidance_scale=g, seed=i, **extra))
        for i, (steps, g, extra) in enumerate(
            [
                (6, 3.0, {}),
                (6, 3.0, {"num_outputs_per_prompt": 2}),
                (6, 1.0, {}),
                (4, 3.0, {}),
                (6, 3.0, {"height": 16, "width": 16}),
                (6, 2.0, {}),
            ]
        )
    ]
    assert_same_images(pipe, specs)


def test_digits_previews_see_each_requests_own_clean_estimate() -> None:
    pipe = DigitsPipeline()
    specs = [(d, SamplingParams(num_inference_steps=5, guidance_scale=3.0)) for d in (1, 7)]
    alone = states_of(pipe, specs)
    together = states_of(pipe, specs)
    for _ in range(2):
        for state, output in zip(alone, pipe.denoise_step(alone), strict=True):
            pipe.step_scheduler(state, output)
        pipe.step_batch(together)
    for one, other in zip(alone, together, strict=True):
        preview, batched = pipe.preview(one), pipe.preview(other)
        assert preview is not None and batched is not None
        assert torch.equal(preview, batched)
        assert other.step_index == 2


# -- the harness's testing-faults pipeline -------------------------------------------------


def test_testing_faults_batched_steps_equal_per_request_steps_bit_for_bit() -> None:
    """Mixed step counts, guidance scales and output counts, and requests finishing together."""
    specs = [
        (prompt, SamplingParams(num_inference_steps=steps, guidance_scale=g, **extra))
        for prompt, steps, g, extra in [
            ("cat", 4, 1.0, {}),
            ("dog", 4, 2.0, {"num_outputs_per_prompt": 2}),
            (7, 2, 1.0, {}),
            ("cat", 5, 1.0, {"seed": 3}),
            ("missing", 4, 1.0, {}),
        ]
    ]
    assert_same_images(FaultInjectingPipeline(batched_steps=True), specs)


def test_testing_faults_has_the_batched_methods_only_when_asked() -> None:
    assert not hasattr(FaultInjectingPipeline(), "step_batch")
    assert not hasattr(FaultInjectingPipeline(), "post_decode_batch")


def test_testing_faults_batched_step_fails_a_bad_step_request_alone() -> None:
    """Its own step fails: it stays where it was (the runner fails it alone), the rest
    advance; a forward made of such steps fails, as a forward with a raising step does."""
    pipe = FaultInjectingPipeline(batched_steps=True)
    params = SamplingParams(num_inference_steps=3)
    states = states_of(pipe, [("cat", params), ("bad-step", params), ("dog", params)])
    pipe.step_batch(states)
    assert [state.step_index for state in states] == [1, 0, 1]
    request = PipelineRequest("r0", "bad-step", params, 0, CPU)
    with pytest.raises(RuntimeError, match="did not advance 'r0'"):
        pipe.forward([request])


def test_testing_faults_batched_step_fails_whole_as_its_denoiser_call_does() -> None:
    pipe = FaultInjectingPipeline(batched_steps=True)
    params = SamplingParams(num_inference_steps=3)
    states = states_of(pipe, [("cat", params), ("fail", params)])
    with pytest.raises(RuntimeError, match="injected failure"):
        pipe.step_batch(states)
    assert pipe.step_batches == [["r0", "r1"]]


# -- diffusers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> Any:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import diffusers_models

    return diffusers_models


@pytest.mark.parametrize(
    ("scheduler", "stacks"),
    [
        ("DDIMScheduler", True),
        ("DDPMScheduler", True),
        ("EulerDiscreteScheduler", True),
        ("EulerAncestralDiscreteScheduler", True),
        ("DPMSolverMultistepScheduler", False),
        ("UniPCMultistepScheduler", False),
        ("DEISMultistepScheduler", False),
        ("HeunDiscreteScheduler", False),
        ("KDPM2DiscreteScheduler", False),
        ("KDPM2AncestralDiscreteScheduler", False),
        ("PNDMScheduler", False),
    ],
)
def test_only_schedulers_without_per_sample_history_share_a_step(
    models: Any, scheduler: str, stacks: bool
) -> None:
    import diffusers

    from diffusion_runtime.pipelines.diffusers.step_probe import steps_stack_exactly

    assert steps_stack_exactly(getattr(diffusers, scheduler)(), min_steps=4) is stacks


@pytest.mark.parametrize(
    "scheduler", ["DDIMScheduler", "DDPMScheduler", "DPMSolverMultistepScheduler"]
)
def test_dit_batched_steps_equal_per_request_steps_bit_for_bit(models: Any, scheduler: str) -> None:
    """Fixed-size denoiser calls make rows independent of their layout, so any difference
    would be the scheduler step's: stochastic DDPM draws each row's noise from its own
    generator; a two-output request and DPM-Solver's history step alone."""
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    pipe = models.with_scheduler(models.dit_pipeline(), scheduler)
    adapter = DiffusersPipeline(pipe, rows_per_call=8)
    assert adapter.stacks_scheduler_steps is (scheduler != "DPMSolverMultistepScheduler")
    specs = [
        (label, SamplingParams(num_inference_steps=steps, guidance_scale=g, **extra))
        for label, steps, g, extra in [
            (1, 4, 3.0, {}),
            (2, 4, 3.0, {}),
            (3, 4, 3.0, {"num_outputs_per_prompt": 2}),
            (4, 4, 1.0, {}),
            (5, 3, 3.0, {}),
            (6, 4, 2.0, {}),
        ]
    ]
    assert_same_images(adapter, specs)


def test_unconditional_stochastic_batched_steps_equal_per_request_steps(models: Any) -> None:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    adapter = DiffusersPipeline(models.ddim_pipeline(), rows_per_call=4)
    specs = [(None, SamplingParams(num_inference_steps=3, extra_args={"eta": 1.0}))] * 3
    assert_same_images(adapter, specs)
