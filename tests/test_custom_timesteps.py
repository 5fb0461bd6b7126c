"""Custom ``timesteps`` and ``sigmas`` (``docs/outputs.md``): validated by field, the step
count derived from them, honoured by the digits pipeline and the diffusers adapter
(equal to diffusers' own ``pipe(..., timesteps=...)``), refused by field at admission
where a pipeline or scheduler cannot take them, and bit-identical alone or batched,
in request or step mode, preempted and resumed or not."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from conftest import factory_of

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.fsm.audit import Auditor
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import MAX_STEPS
from diffusion_runtime.stage.client import StageClient

# Raised inside diffusers' sigma schedulers under numpy 2 (not by the runtime).
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

#: Two schedules of the same length, so only the timesteps tell them apart.
EARLY = (999, 800, 500, 200, 10)
LATE = (900, 600, 300, 100, 0)
CUSTOM = SamplingParams(timesteps=EARLY, seed=4, extra_args={"eta": 0.6}, return_trajectory="full")
OTHER = SamplingParams(timesteps=LATE, seed=4, extra_args={"eta": 0.6}, return_trajectory="full")
DEFAULT = SamplingParams(num_inference_steps=5, seed=4, extra_args={"eta": 0.6})
PROMPTS = ["3", "3", "8"]
REQUESTS = [CUSTOM, OTHER, DEFAULT]


def digits(**fields: Any) -> EngineConfig:
    fields.setdefault("warmup", False)
    return EngineConfig(pipeline="digits", device="cpu", **fields)


def assert_same(output: RequestOutput, expected: RequestOutput) -> None:
    """Bit for bit: images and, when asked, the trajectory's latents, log-probs and steps."""
    assert output.ok, output.error
    assert output.image_batch is not None and expected.image_batch is not None
    assert torch.equal(output.image_batch, expected.image_batch)
    assert (output.trajectory is None) == (expected.trajectory is None)
    if output.trajectory is not None and expected.trajectory is not None:
        mine, theirs = output.trajectory, expected.trajectory
        assert mine.timesteps == theirs.timesteps
        assert torch.equal(mine.latents, theirs.latents)
        assert mine.log_probs is not None and theirs.log_probs is not None
        assert torch.equal(mine.log_probs, theirs.log_probs)


# -- the fields --------------------------------------------------------------------------


def test_a_schedule_is_stored_as_a_tuple_and_sets_the_step_count() -> None:
    params = SamplingParams(timesteps=[999, 500, 1], num_inference_steps=40)
    assert params.timesteps == (999, 500, 1) and params.num_inference_steps == 3
    assert params.custom_schedule == ("timesteps", (999, 500, 1))
    assert hash(params) == hash(SamplingParams(timesteps=(999, 500, 1)))
    sigmas = SamplingParams(sigmas=[14.6, 3.0, 0.5, 0.0])
    assert sigmas.num_inference_steps == 4 and sigmas.custom_schedule is not None
    # Requests of different schedules never share a request-mode batch; a step batch mixes them.
    default = SamplingParams(num_inference_steps=3)
    assert params.request_batch_key() != default.request_batch_key()
    assert params.step_batch_key() == default.step_batch_key()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"timesteps": []}, "timesteps"),
        ({"timesteps": [1, 2]}, "timesteps"),
        ({"timesteps": [5, 5]}, "timesteps"),
        ({"timesteps": [float("nan")]}, "timesteps"),
        ({"timesteps": [-1]}, "timesteps"),
        ({"timesteps": [True]}, "timesteps"),
        ({"timesteps": [10**400, 1]}, "timesteps"),
        ({"timesteps": "999"}, "timesteps"),
        ({"timesteps": list(range(MAX_STEPS, -1, -1))}, "timesteps"),
        ({"sigmas": [float("inf"), 1.0]}, "sigmas"),
        ({"sigmas": [2, 1]}, "sigmas"),
        ({"sigmas": [0.5, 1.0]}, "sigmas"),
        ({"timesteps": [3], "sigmas": [1.0]}, "sigmas"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        SamplingParams(**fields)
    assert caught.value.owner == "SamplingParams" and caught.value.field == field


# -- the digits pipeline -----------------------------------------------------------------


@pytest.fixture(scope="module")
def alone() -> list[RequestOutput]:
    """Each request run alone, in request mode."""
    with DiffusionEngine.make_engine(digits()) as engine:
        return [
            engine.generate([p], params)[0] for p, params in zip(PROMPTS, REQUESTS, strict=True)
        ]


def test_digits_sample_on_the_given_timesteps(alone: list[RequestOutput]) -> None:
    custom, other, _ = alone
    assert custom.trajectory is not None and other.trajectory is not None
    assert custom.trajectory.timesteps == EARLY and other.trajectory.timesteps == LATE
    assert custom.trajectory.latents.shape[0] == len(EARLY) + 1
    assert custom.image_batch is not None and other.image_batch is not None
    assert not torch.equal(custom.image_batch, other.image_batch)


@pytest.mark.parametrize(("mode", "backend"), [("request", "uni"), ("step", "uni"), ("step", "mp")])
def test_digits_batched_equal_alone_in_every_mode(
    alone: list[RequestOutput], mode: str, backend: str
) -> None:
    """Two schedules of one length and the default schedule, submitted together: one
    step batch in step mode (the step groups must keep the schedules apart), one wave
    per schedule in request mode."""
    progress: dict[str, set[int | None]] = {}
    with DiffusionEngine.make_engine(
        digits(execution_mode=mode, executor_backend=backend)
    ) as engine:
        outputs = engine.generate(PROMPTS, REQUESTS)
    for output, expected in zip(outputs, alone, strict=True):
        assert_same(output, expected)
        progress.setdefault(output.request_id, set()).add(output.num_steps)
    if mode == "step":  # the resolved step count is what progress reports
        assert all(steps == {len(EARLY)} for steps in progress.values()), progress


def test_a_preempted_request_resumes_on_its_own_timesteps(alone: list[RequestOutput]) -> None:
    low = attrs.evolve(CUSTOM, priority=5)
    core = EngineCore(
        digits(
            execution_mode="step",
            scheduling_policy="priority",
            max_num_seqs=1,
            preempted_offload_bytes=2**30,
            audit="raise",
        )
    )
    try:
        core.add_request("low", PROMPTS[0], low, seed=4)
        core.step()
        core.step()
        core.add_request("high", PROMPTS[2], DEFAULT, seed=4)
        preempted, finals = False, {}
        while core.has_unfinished():
            for output in core.step().outputs:
                if output.finished:
                    finals[output.request_id] = output
                else:
                    assert output.num_steps == len(EARLY)
            state = core.scheduler.requests.get("low")
            preempted |= state is not None and state.state is RequestStatus.PREEMPTED
    finally:
        core.shutdown()
    assert preempted
    assert_same(finals["low"], alone[0])


def test_the_stage_carries_a_schedule(alone: list[RequestOutput]) -> None:
    async def scenario() -> RequestOutput:
        async with StageClient(digits(execution_mode="step")) as client:
            [output] = await client.generate([PROMPTS[0]], CUSTOM)
            return output

    assert_same(asyncio.run(scenario()), alone[0])


@pytest.mark.parametrize(
    ("params", "owner", "field"),
    [
        (SamplingParams(sigmas=[1.0, 0.5]), "SamplingParams", "sigmas"),
        (SamplingParams(timesteps=[1000, 3]), "DigitsPipeline", "timesteps"),
        (SamplingParams(timesteps=[500.5, 3]), "DigitsPipeline", "timesteps"),
    ],
)
def test_digits_refuse_what_they_cannot_take_at_admission(
    params: SamplingParams, owner: str, field: str
) -> None:
    with DiffusionEngine.make_engine(digits()) as engine:
        with pytest.raises(InvalidFieldError) as caught:
            engine.generate(["1"], params)
        assert (caught.value.owner, caught.value.field) == (owner, field)
        [ok] = engine.generate(["1"], SamplingParams(num_inference_steps=1, seed=0))
        assert ok.ok


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_a_pipeline_that_declares_no_schedules_refuses_them_at_admission(backend: str) -> None:
    """``testing-null`` has no ``validate_request``: on mp, a request that asks for a
    schedule still reaches rank 0's check."""
    config = EngineConfig(pipeline="testing-null", device="cpu", executor_backend=backend)
    with DiffusionEngine.make_engine(config) as engine:
        with pytest.raises(InvalidFieldError, match="NullPipeline does not") as caught:
            engine.generate(["x"], SamplingParams(timesteps=[3, 2, 1]))
        assert caught.value.field == "timesteps"
        assert engine.generate(["x"], SamplingParams(num_inference_steps=1))[0].ok


# -- the diffusers adapter ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sd(models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pipe = models.stable_diffusion_pipeline(tmp_path_factory.mktemp("tokenizer"))
    return {
        "ddim": pipe,
        "euler": models.with_scheduler(pipe, "EulerDiscreteScheduler"),
        "ddpm": models.with_scheduler(pipe, "DDPMScheduler"),
    }


DIFFUSERS_CASES = {
    "euler-timesteps": ("euler", {"timesteps": [999, 600, 300, 50]}),
    "euler-sigmas": ("euler", {"sigmas": [14.0, 5.0, 1.0, 0.2]}),
    "ddpm-timesteps": ("ddpm", {"timesteps": [999, 500, 20]}),
}


def diffusers_engine(adapter: Any, mode: str) -> DiffusionEngine:
    return DiffusionEngine.make_engine(
        EngineConfig(pipeline=factory_of(adapter), device="cpu", execution_mode=mode, warmup=False)
    )


@pytest.mark.parametrize("case", sorted(DIFFUSERS_CASES))
def test_a_schedule_equals_diffusers_own_call_bit_for_bit(sd: dict[str, Any], case: str) -> None:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    scheduler, schedule = DIFFUSERS_CASES[case]
    pipe = sd[scheduler]
    generator = torch.Generator().manual_seed(11)
    expected = pipe(
        prompt="x", generator=generator, output_type="pt", guidance_scale=2.0, **schedule
    ).images
    params = SamplingParams(seed=11, guidance_scale=2.0, **schedule)
    for mode in ("request", "step"):
        with diffusers_engine(DiffusersPipeline(pipe), mode) as engine:
            [output] = engine.generate(["x"], params)
        assert output.ok, output.error
        assert output.image_batch is not None
        assert torch.equal(output.image_batch, expected), mode


def test_diffusers_steps_mix_schedules_and_keep_each_requests_output(sd: dict[str, Any]) -> None:
    """Euler stacks requests at one step into one scheduler step; requests of two
    schedules and of the default one share every denoiser call, and each gets what
    it got alone (fixed-size denoiser calls make that exact)."""
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    adapter = DiffusersPipeline(sd["euler"], rows_per_call=4)
    assert adapter.stacks_scheduler_steps
    requests = [
        SamplingParams(seed=1, timesteps=[999, 600, 300, 50]),
        SamplingParams(seed=1, timesteps=[900, 700, 200, 10]),
        SamplingParams(seed=1, sigmas=[14.0, 5.0, 1.0, 0.2]),
        SamplingParams(seed=1, num_inference_steps=4),
    ]
    with diffusers_engine(adapter, "step") as engine:
        alone = [engine.generate(["x"], params)[0] for params in requests]
        together = engine.generate(["x"] * len(requests), requests)
    for output, expected in zip(together, alone, strict=True):
        assert_same(output, expected)
    # Euler ends its schedule at the last sigma: 4 sigmas are 3 steps (docs/outputs.md).
    assert [output.num_steps for output in together] == [4, 4, 3, 4]
    images = [output.image_batch for output in alone]
    assert all(not torch.equal(images[0], other) for other in images[1:])


def test_diffusers_refuse_a_schedule_their_scheduler_cannot_take(sd: dict[str, Any]) -> None:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    ddim, ddpm = DiffusersPipeline(sd["ddim"]), DiffusersPipeline(sd["ddpm"])
    assert ddim.custom_schedules == frozenset()
    assert ddpm.custom_schedules == {"timesteps"}
    with (
        diffusers_engine(ddim, "step") as engine,
        pytest.raises(InvalidFieldError, match="DiffusersPipeline does not"),
    ):
        engine.generate(["x"], SamplingParams(timesteps=[999, 500]))
    with diffusers_engine(ddpm, "request") as engine:
        with pytest.raises(InvalidFieldError, match="rejected by DDPMScheduler") as caught:
            engine.generate(["x"], SamplingParams(timesteps=[1500, 3]))
        assert caught.value.field == "timesteps"
        with pytest.raises(InvalidFieldError) as refused:
            engine.generate(["x"], SamplingParams(sigmas=[1.0, 0.5]))
        assert refused.value.field == "sigmas"
        assert engine.generate(["x"], SamplingParams(timesteps=[999, 3], seed=0))[0].ok


def test_the_documented_example_prints_what_the_docs_say(
    capsys: pytest.CaptureFixture[str],
) -> None:
    page = (Path(__file__).parent.parent / "docs" / "outputs.md").read_text()
    marker = "timesteps=[999, 900, 600, 200]"
    [(code, printed)] = [
        (code, printed)
        for code, printed in re.findall(r"```python\n(.*?)```.*?```text\n(.*?)```", page, re.S)
        if marker in code
    ]
    exec(compile(code, "outputs.md", "exec"), {})
    assert capsys.readouterr().out == printed


def test_the_auditor_tells_requests_apart_by_their_schedule() -> None:
    """Two requests equal but for their schedules give different images, and the
    identity invariant (INV-005: equal inputs, equal outputs) counts the schedule
    among the inputs."""
    auditor = Auditor()
    same_length = [
        SamplingParams(seed=0, timesteps=[999, 500]),
        SamplingParams(seed=0, timesteps=[700, 100]),
        SamplingParams(seed=0, num_inference_steps=2),
    ]
    with DiffusionEngine.make_engine(digits()) as engine:
        engine.machine.subscribe(auditor.feed)
        outputs = engine.generate(["4"] * 3, same_length)
    assert all(output.ok for output in outputs)
    images = [output.image_batch for output in outputs]
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    assert [violation.describe() for violation in auditor.finish()] == []
