"""What a request can get back besides images (``docs/outputs.md``): its final latents
(``output_type="latent"``) and its trajectory with log-probabilities
(``return_trajectory``), on the digits pipeline with stochastic DDIM steps.

The log-probabilities are recomputed here from the trajectory, the network and the
DDIM posterior written out independently; every output is bit-identical alone or
batched, in request or step mode, preempted (state offloaded) or not, and through
the mp, Ray and stage executors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from conftest import factory_of

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.digits.model import cosine_alpha_bars
from diffusion_runtime.pipelines.digits.pipeline import DigitsPipeline
from diffusion_runtime.stage.client import StageClient

ETA = 0.8
RL = SamplingParams(
    num_inference_steps=6,
    seed=11,
    guidance_scale=2.0,
    num_outputs_per_prompt=2,
    extra_args={"eta": ETA},
    return_trajectory="full",
)
LATENT = SamplingParams(
    num_inference_steps=4,
    seed=5,
    extra_args={"eta": 0.3},
    output_type="latent",
    return_trajectory="latents",
)
PLAIN = SamplingParams(num_inference_steps=5, seed=2)


def config(**fields: object) -> EngineConfig:
    fields.setdefault("warmup", False)
    return EngineConfig(pipeline="digits", device="cpu", **fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def alone() -> dict[str, RequestOutput]:
    """Each request run alone, in request mode on the uni executor."""
    outputs = {}
    with DiffusionEngine.make_engine(config()) as engine:
        for prompt, params in (("3", RL), ("7", LATENT), ("1", PLAIN)):
            [outputs[prompt]] = engine.generate([prompt], params)
    return outputs


def assert_same(output: RequestOutput, expected: RequestOutput) -> None:
    """Bit for bit: images, latents, the trajectory's tensors and step numbers."""
    assert output.ok, output
    for name in ("image_batch", "latents"):
        mine, theirs = getattr(output, name), getattr(expected, name)
        assert (mine is None) == (theirs is None), name
        assert mine is None or torch.equal(mine, theirs), name
    assert (output.trajectory is None) == (expected.trajectory is None)
    if output.trajectory is not None and expected.trajectory is not None:
        mine_t, theirs_t = output.trajectory, expected.trajectory
        assert torch.equal(mine_t.latents, theirs_t.latents)
        assert mine_t.timesteps == theirs_t.timesteps
        assert mine_t.log_prob_steps == theirs_t.log_prob_steps
        assert (mine_t.log_probs is None) == (theirs_t.log_probs is None)
        assert mine_t.log_probs is None or torch.equal(mine_t.log_probs, theirs_t.log_probs)


def test_a_trajectory_holds_every_step_and_ends_at_the_output(
    alone: dict[str, RequestOutput],
) -> None:
    rl, latent = alone["3"], alone["7"]
    assert rl.trajectory is not None and rl.image_batch is not None and rl.latents is None
    steps = RL.num_inference_steps
    assert rl.trajectory.latents.shape == (steps + 1, 2, 64)
    assert len(rl.trajectory.timesteps) == steps
    # DDIM's last step returns the clean estimate: it draws no noise, so it has no density.
    assert rl.trajectory.log_prob_steps == tuple(range(steps - 1))
    assert rl.trajectory.log_probs is not None and rl.trajectory.log_probs.shape == (steps - 1, 2)
    assert rl.trajectory.log_probs.dtype == torch.float64
    assert torch.isfinite(rl.trajectory.log_probs).all()
    # The images are the last latents decoded.
    decoded = ((rl.trajectory.latents[-1] + 1) / 2).clamp(0, 1).reshape(2, 1, 8, 8)
    assert torch.equal(rl.image_batch, decoded)

    assert latent.image_batch is None and latent.latents is not None
    assert latent.latents.shape == (1, 64)
    assert latent.trajectory is not None and latent.trajectory.log_probs is None
    assert torch.equal(latent.trajectory.latents[-1], latent.latents)
    assert latent.trajectory.log_prob_steps == ()
    assert alone["1"].trajectory is None and alone["1"].latents is None


def test_log_probs_equal_the_ddim_posterior_density_computed_independently(
    alone: dict[str, RequestOutput],
) -> None:
    """Each step's log-prob is the Gaussian density of the sampled latents given the
    latents before the step: mean and variance from the DDIM posterior (Song et al.,
    eq. 12 and 16) written out here, the noise prediction from the network itself."""
    trajectory = alone["3"].trajectory
    assert trajectory is not None and trajectory.log_probs is not None
    pipeline = DigitsPipeline("cpu")
    alpha_bars = cosine_alpha_bars(pipeline.config.num_train_timesteps).double()
    labels = torch.full((2,), 3)
    null = torch.full((2,), pipeline.config.null_class)
    for k, step in enumerate(trajectory.log_prob_steps):
        x = trajectory.latents[step]
        t, t_next = trajectory.timesteps[step], trajectory.timesteps[step + 1]
        with torch.inference_mode():
            times = torch.full((4,), t)
            eps_both = pipeline.model.predict_noise_row_stable(
                torch.cat([x, x]), times, torch.cat([labels, null]), 32, None
            )
        cond, uncond = eps_both.double().chunk(2)
        eps = uncond + RL.guidance_scale * (cond - uncond)
        ab, ab_next = alpha_bars[t], alpha_bars[t_next]
        x0 = ((x.double() - (1 - ab).sqrt() * eps) / ab.sqrt()).clamp(-1, 1)
        implied_eps = (x.double() - ab.sqrt() * x0) / (1 - ab).sqrt()
        variance = ETA**2 * (1 - ab_next) / (1 - ab) * (1 - ab / ab_next)
        mean = ab_next.sqrt() * x0 + (1 - ab_next - variance).sqrt() * implied_eps
        density = torch.distributions.Normal(mean, variance.sqrt())
        expected = density.log_prob(trajectory.latents[step + 1].double()).sum(dim=1)
        torch.testing.assert_close(trajectory.log_probs[k], expected, rtol=1e-6, atol=1e-3)


def test_a_deterministic_sampler_reports_no_log_probs() -> None:
    params = SamplingParams(num_inference_steps=4, seed=1, return_trajectory="full")
    with DiffusionEngine.make_engine(config()) as engine:
        [output] = engine.generate(["5"], params)
    assert output.trajectory is not None
    assert output.trajectory.log_probs is None and output.trajectory.log_prob_steps == ()
    assert output.trajectory.latents.shape == (5, 1, 64)


@pytest.mark.parametrize(("mode", "backend"), [("request", "uni"), ("step", "uni"), ("step", "mp")])
def test_outputs_are_bit_identical_alone_or_batched_in_every_mode_and_executor(
    alone: dict[str, RequestOutput], mode: str, backend: str
) -> None:
    """The three requests batched together (one wave, or shared steps) on each
    executor give what each gave alone (Ray: ``tests/test_ray_executor.py``, on its
    cluster)."""
    with DiffusionEngine.make_engine(
        config(execution_mode=mode, executor_backend=backend)
    ) as engine:
        outputs = engine.generate(["3", "7", "1"], [RL, LATENT, PLAIN])
    for prompt, output in zip(["3", "7", "1"], outputs, strict=True):
        assert_same(output, alone[prompt])


def test_a_preempted_request_resumes_its_trajectory_from_host_memory(
    alone: dict[str, RequestOutput],
) -> None:
    """A low-priority trajectory request is preempted after two steps by a
    high-priority one, its state (recorder included) offloaded to host memory,
    then resumed: its trajectory equals the uninterrupted one."""
    low = attrs.evolve(RL, priority=5)
    core = EngineCore(
        config(
            execution_mode="step",
            scheduling_policy="priority",
            max_num_seqs=1,
            preempted_offload_bytes=2**30,
            audit="raise",
        )
    )
    try:
        core.add_request("low", "3", low, seed=11)
        core.step()
        core.step()
        core.add_request("high", "9", PLAIN, seed=2)
        preempted = False
        finals = {}
        while core.has_unfinished():
            finals.update({o.request_id: o for o in core.step().outputs if o.finished})
            state = core.scheduler.requests.get("low")
            preempted |= state is not None and state.state is RequestStatus.PREEMPTED
    finally:
        core.shutdown()
    assert preempted
    assert_same(finals["low"], alone["3"])
    assert finals["high"].ok and finals["high"].trajectory is None


def test_the_stage_carries_latents_and_trajectories_as_raw_frames(
    alone: dict[str, RequestOutput],
) -> None:
    async def scenario() -> list[RequestOutput]:
        async with StageClient(config(execution_mode="step")) as client:
            finals = []
            for prompt, params in (("3", RL), ("7", LATENT)):
                request_id = await client.add_request(prompt, params)
                finals.append([o async for o in client.stream(request_id)][-1])
            return finals

    async def batch() -> RequestOutput:
        async with StageClient(config(execution_mode="step")) as client:
            return await client.add_batch_request(["3", "3"], RL)

    rl, latent = asyncio.run(scenario())
    merged = asyncio.run(batch())
    assert_same(rl, alone["3"])
    assert_same(latent, alone["7"])
    # A batch's parent concatenates its prompts' outputs along the batch dimension N.
    one = alone["3"]
    assert one.image_batch is not None and one.trajectory is not None
    assert one.trajectory.log_probs is not None
    twice = attrs.evolve(
        one,
        image_batch=torch.cat([one.image_batch] * 2),
        trajectory=attrs.evolve(
            one.trajectory,
            latents=torch.cat([one.trajectory.latents] * 2, dim=1),
            log_probs=torch.cat([one.trajectory.log_probs] * 2, dim=1),
        ),
    )
    assert_same(merged, twice)


@pytest.fixture
def engine() -> Iterator[DiffusionEngine]:
    with DiffusionEngine.make_engine(config(max_trajectory_steps=8)) as engine:
        yield engine


def test_what_cannot_be_returned_is_refused_by_field_and_the_engine_serves_on(
    engine: DiffusionEngine, alone: dict[str, RequestOutput]
) -> None:
    too_long = SamplingParams(num_inference_steps=9, return_trajectory="latents")
    with pytest.raises(InvalidFieldError, match=r"return_trajectory needs num_inference_steps"):
        engine.generate(["1"], too_long)
    with pytest.raises(
        InvalidFieldError, match=r"extra_args\['eta'\] must be a number in \[0, 1\]"
    ):
        engine.generate(["1"], SamplingParams(extra_args={"eta": 1.5}))
    with pytest.raises(InvalidFieldError, match="return_trajectory must be False, 'latents' or"):
        SamplingParams(return_trajectory=True)
    with pytest.raises(InvalidFieldError, match="output_type must be one of 'pil', 'pt', 'latent'"):
        SamplingParams(output_type="np")
    assert engine.snapshot().scheduler_ids == frozenset()
    [output] = engine.generate(["3"], RL)
    assert_same(output, alone["3"])


def test_request_mode_refuses_output_options_a_pipeline_cannot_return() -> None:
    """The null pipeline's own forward returns images only."""
    null = EngineConfig(pipeline="testing-null", device="cpu", warmup=False)
    with DiffusionEngine.make_engine(null) as engine:
        for params, field in (
            (SamplingParams(output_type="latent"), "output_type"),
            (SamplingParams(return_trajectory="full"), "return_trajectory"),
        ):
            with pytest.raises(InvalidFieldError, match=rf"SamplingParams.{field} needs step mode"):
                engine.generate(["x"], params)
        assert engine.generate(["x"], SamplingParams(num_inference_steps=1))[0].ok


def test_a_diffusers_pipeline_returns_latents_and_trajectories(
    models: Any, make_engine: Callable[..., DiffusionEngine]
) -> None:
    """The tiny DiT: its final latents and trajectory are the same bits in request and
    step mode; its DDIM steps (``eta`` 0) draw no noise, so ``"full"`` reports no
    log-probabilities (``tests/test_diffusers_log_probs.py`` has those that do)."""
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    adapter = DiffusersPipeline(models.dit_pipeline())
    params = SamplingParams(
        num_inference_steps=3, seed=4, output_type="latent", return_trajectory="latents"
    )
    finals = []
    for mode in ("request", "step"):
        engine = make_engine(factory_of(adapter), execution_mode=mode, warmup=False)
        [output] = engine.generate([1], params)
        assert output.ok and output.latents is not None and output.trajectory is not None
        assert output.trajectory.latents.shape == (4, *output.latents.shape)
        assert torch.equal(output.trajectory.latents[-1], output.latents)
        finals.append(output)
        [full] = engine.generate([1], attrs.evolve(params, return_trajectory="full"))
        assert full.trajectory is not None and torch.equal(
            full.trajectory.latents, output.trajectory.latents
        )
        assert full.trajectory.log_probs is None and full.trajectory.log_prob_steps == ()
    assert_same(finals[1], finals[0])
