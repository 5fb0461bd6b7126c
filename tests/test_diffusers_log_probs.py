"""Log-probabilities from the diffusers adapter (``docs/outputs.md``): ``DDPMScheduler`` and
``DDIMScheduler`` with ``eta > 0`` on the tiny ``DDPMPipeline`` and ``DDIMPipeline``.

Each step's log-prob is recomputed here from the returned trajectory, the UNet and the
scheduler's posterior written out independently (float64, ``torch.distributions.Normal``),
and the noise that gives it is the noise the request's generator drew. Images stay
diffusers' own; trajectories and log-probs are the same bits alone or batched, in request
or step mode, and on mp. Schedulers that draw no noise report none; others are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from conftest import factory_of

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.outputs import RequestOutput, Trajectory
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

Build = Callable[..., DiffusionEngine]
# Raised inside diffusers' sigma schedulers under numpy 2 (not by the runtime).
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
ETA = 0.6
STEPS = 4


@pytest.fixture(scope="module")
def pipes(models: Any) -> dict[str, Any]:
    ddpm, ddim = models.ddpm_pipeline(), models.ddim_pipeline()
    return {
        "ddpm": ddpm,
        "ddpm-large": models.with_scheduler(ddpm, "DDPMScheduler", variance_type="fixed_large"),
        "ddim": ddim,
        # Stable Diffusion's DDIM settings: the schedule ends at alphas_cumprod[0] < 1 and
        # its last step starts from t = 1, so that step adds noise too.
        "ddim-open": models.with_scheduler(
            ddim, "DDIMScheduler", set_alpha_to_one=False, steps_offset=1
        ),
    }


def full(seed: int, **fields: Any) -> SamplingParams:
    fields.setdefault("num_inference_steps", STEPS)
    fields.setdefault("return_trajectory", "full")
    return SamplingParams(seed=seed, output_type="pt", **fields)


def run_alone(
    make_engine: Build, adapter: DiffusersPipeline, params: SamplingParams, mode: str
) -> RequestOutput:
    engine = make_engine(factory_of(adapter), execution_mode=mode, warmup=False)
    [output] = engine.generate([None], params)
    assert output.ok, output.error
    return output


# -- the densities, computed independently -----------------------------------------------


def unet_output(pipe: Any, x: torch.Tensor, t: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = pipe.unet(x, torch.full((len(x),), t)).sample
    return out


def ddpm_gaussian(
    pipe: Any, trajectory: Trajectory, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DDPM posterior of step ``step`` (the paper's eq. 6-7; its variance as the
    scheduler's variance type sets it), written out from the trajectory."""
    scheduler = pipe.scheduler
    alphas_cumprod = scheduler.alphas_cumprod.double()
    t = trajectory.timesteps[step]
    prev = trajectory.timesteps[step + 1] if step + 1 < len(trajectory.timesteps) else -1
    ab = alphas_cumprod[t]
    ab_prev = alphas_cumprod[prev] if prev >= 0 else torch.tensor(1.0, dtype=torch.float64)
    beta = 1 - ab / ab_prev
    x = trajectory.latents[step].double()
    eps = unet_output(pipe, trajectory.latents[step], t).double()
    x0 = ((x - (1 - ab).sqrt() * eps) / ab.sqrt()).clamp(-1, 1)  # clip_sample=True
    mean = ab_prev.sqrt() * beta / (1 - ab) * x0 + (1 - beta).sqrt() * (1 - ab_prev) / (1 - ab) * x
    if scheduler.config.variance_type == "fixed_large":
        variance = beta
    else:
        assert scheduler.config.variance_type == "fixed_small"
        variance = (1 - ab_prev) / (1 - ab) * beta
    return mean, variance.sqrt()


def ddim_gaussian(
    pipe: Any, trajectory: Trajectory, step: int, eps: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DDIM step's Gaussian (the paper's eq. 12 and 16) for ``ETA``; ``eps`` is the
    (guided) noise prediction, the UNet's own output when not given."""
    scheduler = pipe.scheduler
    alphas_cumprod = scheduler.alphas_cumprod.double()
    t = trajectory.timesteps[step]
    prev = t - scheduler.config.num_train_timesteps // len(trajectory.timesteps)
    final = 1.0 if scheduler.config.set_alpha_to_one else alphas_cumprod[0]
    ab = alphas_cumprod[t]
    ab_prev = alphas_cumprod[prev] if prev >= 0 else torch.as_tensor(final, dtype=torch.float64)
    sigma = ETA * ((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)).sqrt()
    x = trajectory.latents[step].double()
    if eps is None:
        eps = unet_output(pipe, trajectory.latents[step], t)
    eps = eps.double()
    x0 = (x - (1 - ab).sqrt() * eps) / ab.sqrt()
    if scheduler.config.clip_sample:
        x0 = x0.clamp(-1, 1)
    mean = ab_prev.sqrt() * x0 + (1 - ab_prev - sigma**2).sqrt() * eps
    return mean, sigma


GAUSSIANS = {"ddpm": ddpm_gaussian, "ddpm-large": ddpm_gaussian}
GAUSSIANS |= {"ddim": ddim_gaussian, "ddim-open": ddim_gaussian}
#: The steps with a log-prob, of 4: DDPM's last (t = 0) adds no noise, nor does DDIM's
#: when its schedule ends at alpha 1; ``ddim-open``'s last step adds noise.
DRAWN_STEPS = {"ddpm": (0, 1, 2), "ddpm-large": (0, 1, 2), "ddim": (0, 1, 2)}
DRAWN_STEPS["ddim-open"] = (0, 1, 2, 3)


@pytest.mark.parametrize("name", sorted(GAUSSIANS))
def test_log_probs_equal_the_posterior_density_computed_independently(
    make_engine: Build, pipes: dict[str, Any], name: str
) -> None:
    """rtol 1e-6 against ``Normal(mean, std).log_prob`` of the next latents, and the noise
    behind each step is the request's generator's draw (replayed: the initial latents,
    then one draw per step that draws, as diffusers draws them)."""
    pipe = pipes[name]
    extra = {"eta": ETA} if name.startswith("ddim") else {}
    params = full(7, num_outputs_per_prompt=2, extra_args=extra)
    output = run_alone(make_engine, DiffusersPipeline(pipe), params, "request")
    trajectory = output.trajectory
    assert trajectory is not None and trajectory.log_probs is not None
    assert trajectory.log_prob_steps == DRAWN_STEPS[name]
    assert trajectory.log_probs.shape == (len(DRAWN_STEPS[name]), 2)
    assert trajectory.log_probs.dtype == torch.float64

    replay = torch.Generator().manual_seed(7)
    shape = trajectory.latents.shape[1:]
    assert torch.equal(torch.randn(shape, generator=replay), trajectory.latents[0])
    for k, step in enumerate(trajectory.log_prob_steps):
        mean, std = GAUSSIANS[name](pipe, trajectory, step)
        drawn = trajectory.latents[step + 1].double()
        expected = torch.distributions.Normal(mean, std).log_prob(drawn).flatten(1).sum(dim=1)
        torch.testing.assert_close(trajectory.log_probs[k], expected, rtol=1e-6, atol=0)
        noise = torch.randn(shape, generator=replay).double()
        torch.testing.assert_close((drawn - mean) / std, noise, rtol=0, atol=1e-3)


def test_guided_stable_diffusion_ddim_steps_have_the_posterior_density(
    make_engine: Build, models: Any, tmp_path: Path
) -> None:
    """Stable Diffusion's DDIM (``set_alpha_to_one=False``: every step adds noise) with
    ``eta`` and guidance: the density from the guided noise prediction, and the images
    diffusers' own."""
    pipe = models.stable_diffusion_pipeline(tmp_path)
    guidance, extra = 3.0, {"eta": ETA}
    generator = torch.Generator().manual_seed(9)
    expected = pipe(
        "a b",
        generator=generator,
        num_inference_steps=STEPS,
        output_type="pt",
        guidance_scale=guidance,
        eta=ETA,
    ).images
    params = full(9, guidance_scale=guidance, extra_args=extra)
    engine = make_engine(factory_of(DiffusersPipeline(pipe)), warmup=False)
    [output] = engine.generate(["a b"], params)
    assert output.ok and torch.equal(output.image_batch, expected)
    trajectory = output.trajectory
    assert trajectory is not None and trajectory.log_probs is not None
    assert trajectory.log_prob_steps == tuple(range(STEPS))
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt("a b", "cpu", 1, True)
        rows = torch.cat([negative, embeds])
        for k, step in enumerate(trajectory.log_prob_steps):
            x, t = trajectory.latents[step], trajectory.timesteps[step]
            both = pipe.unet(torch.cat([x, x]), t, encoder_hidden_states=rows).sample
            uncond, cond = both.chunk(2)
            mean, std = ddim_gaussian(pipe, trajectory, step, uncond + guidance * (cond - uncond))
            drawn = trajectory.latents[step + 1].double()
            density = torch.distributions.Normal(mean, std).log_prob(drawn).flatten(1).sum(dim=1)
            torch.testing.assert_close(trajectory.log_probs[k], density, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_full_trajectories_leave_the_images_diffusers_own_in_both_modes(
    make_engine: Build, pipes: dict[str, Any], name: str
) -> None:
    pipe = pipes[name]
    extra = {"eta": ETA} if name == "ddim" else {}
    generator = torch.Generator().manual_seed(3)
    expected = pipe(generator=generator, num_inference_steps=STEPS, output_type="pt", **extra)
    params = full(3, extra_args=extra)
    outputs = {
        (mode, kind): run_alone(
            make_engine,
            DiffusersPipeline(pipe),
            attrs.evolve(params, return_trajectory=kind),
            mode,
        )
        for mode in ("request", "step")
        for kind in ("full", False)
    }
    for key, output in outputs.items():
        assert torch.equal(output.image_batch, expected.images), key
    assert_same_trajectory(outputs["step", "full"], outputs["request", "full"])


def assert_same_trajectory(output: RequestOutput, expected: RequestOutput) -> None:
    """Bit for bit: images, the trajectory's latents, steps and log-probs."""
    assert output.ok, output.error
    assert output.image_batch is not None and expected.image_batch is not None
    assert torch.equal(output.image_batch, expected.image_batch)
    mine, theirs = output.trajectory, expected.trajectory
    assert mine is not None and theirs is not None
    assert torch.equal(mine.latents, theirs.latents)
    assert (mine.timesteps, mine.log_prob_steps) == (theirs.timesteps, theirs.log_prob_steps)
    assert (mine.log_probs is None) == (theirs.log_probs is None)
    assert mine.log_probs is None or torch.equal(mine.log_probs, theirs.log_probs)


# -- alone or batched, request or step mode, in process or mp -------------------------------

#: Two requests that share every scheduler step in step mode (one only asks for latents),
#: and one of another length with two images.
BATCH = [
    full(1),
    full(2, return_trajectory="latents"),
    full(3, num_inference_steps=5, num_outputs_per_prompt=2),
    full(4),
]


@pytest.fixture(scope="module")
def batch_alone(pipes: dict[str, Any]) -> dict[str, list[RequestOutput]]:
    """Each request of ``BATCH`` alone, request mode, through an engine per pipeline.

    Every engine compared with these runs torch on one thread, as they do: the
    VAE's convolutions round differently on another thread count (the mp worker
    takes all cores by default, this process what earlier tests left it)."""
    alone: dict[str, list[RequestOutput]] = {}
    for name, extra in (("ddpm", {}), ("ddim", {"eta": ETA})):
        adapter = DiffusersPipeline(pipes[name], rows_per_call=8)
        config = EngineConfig(
            pipeline=factory_of(adapter), device="cpu", warmup=False, intra_op_threads=1
        )
        with DiffusionEngine.make_engine(config) as engine:
            alone[name] = [
                engine.generate([None], attrs.evolve(p, extra_args=extra))[0] for p in BATCH
            ]
    return alone


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_trajectories_and_log_probs_are_bit_identical_alone_or_batched(
    make_engine: Build,
    pipes: dict[str, Any],
    batch_alone: dict[str, list[RequestOutput]],
    name: str,
    mode: str,
) -> None:
    """Fixed-size denoiser calls (``rows_per_call``) make each request's model output
    independent of its batch mates, as the adapter's identity tests assume."""
    extra = {"eta": ETA} if name == "ddim" else {}
    adapter = DiffusersPipeline(pipes[name], rows_per_call=8)
    engine = make_engine(
        factory_of(adapter), execution_mode=mode, warmup=False, max_num_seqs=4, intra_op_threads=1
    )
    params = [attrs.evolve(p, extra_args=extra) for p in BATCH]
    outputs = engine.generate([None] * len(params), params)
    for output, expected in zip(outputs, batch_alone[name], strict=True):
        assert_same_trajectory(output, expected)
    assert outputs[0].trajectory is not None and outputs[0].trajectory.log_probs is not None
    assert outputs[1].trajectory is not None and outputs[1].trajectory.log_probs is None


def test_trajectories_and_log_probs_cross_mp_bit_for_bit(
    make_engine: Build,
    pipes: dict[str, Any],
    batch_alone: dict[str, list[RequestOutput]],
    tmp_path: Path,
) -> None:
    pipes["ddpm"].save_pretrained(tmp_path)
    engine = make_engine(
        "diffusers",
        pipeline_kwargs={"path": str(tmp_path), "rows_per_call": 8},
        executor_backend="mp",
        execution_mode="step",
        warmup=False,
        intra_op_threads=1,
    )
    outputs = engine.generate([None] * len(BATCH), BATCH)
    for output, expected in zip(outputs, batch_alone["ddpm"], strict=True):
        assert_same_trajectory(output, expected)


# -- no noise, no density; noise without a density is refused --------------------------------


DETERMINISTIC = [
    ("ddim", None, {"eta": 0.0}),
    ("ddim", None, {}),
    ("ddpm", "DPMSolverMultistepScheduler", {}),
    ("ddpm", "UniPCMultistepScheduler", {}),
]


@pytest.mark.parametrize(("name", "scheduler", "extra"), DETERMINISTIC)
def test_a_scheduler_that_draws_no_noise_reports_no_log_probs(
    make_engine: Build,
    models: Any,
    pipes: dict[str, Any],
    name: str,
    scheduler: str | None,
    extra: dict[str, Any],
) -> None:
    pipe = pipes[name] if scheduler is None else models.with_scheduler(pipes[name], scheduler)
    for mode in ("request", "step"):
        output = run_alone(make_engine, DiffusersPipeline(pipe), full(5, extra_args=extra), mode)
        trajectory = output.trajectory
        assert trajectory is not None and trajectory.latents.shape[0] == STEPS + 1
        assert trajectory.log_probs is None and trajectory.log_prob_steps == ()


REFUSED = [
    ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}, "noise"),
    ("DDPMScheduler", {"variance_type": "fixed_large_log"}, "variance_type 'fixed_large_log'"),
]


@pytest.mark.parametrize(("scheduler", "config", "why"), REFUSED)
def test_noise_without_a_density_is_refused_by_field_and_the_engine_serves_on(
    make_engine: Build,
    models: Any,
    pipes: dict[str, Any],
    scheduler: str,
    config: dict[str, Any],
    why: str,
) -> None:
    pipe = models.with_scheduler(pipes["ddpm"], scheduler, **config)
    engine = make_engine(factory_of(DiffusersPipeline(pipe)), warmup=False)
    with pytest.raises(
        InvalidFieldError, match=f"'full' needs log-probabilities.*{scheduler}"
    ) as info:
        engine.generate([None], full(1))
    assert info.value.field == "return_trajectory" and why in str(info.value)
    [output] = engine.generate([None], full(1, return_trajectory="latents"))
    assert output.ok and output.trajectory is not None
