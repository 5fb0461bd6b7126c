"""Log-probabilities of the steps a diffusers scheduler takes (``return_trajectory="full"``).

A stochastic step draws ``x_{t-1} = mean + std * z`` inside ``scheduler.step``,
with ``z`` from the request's generator. The adapter leaves that call alone (so
its images stay diffusers' own) and recomputes the step's Gaussian, its mean
and standard deviation in float64 by the scheduler's own formulas, from
``x_t`` and the model output; the log-probability is the density of the
``x_{t-1}`` the step returned under that Gaussian, whatever noise produced it.

:func:`step_densities` decides once per scheduler how its steps are scored:
``DDPMScheduler`` (the variance types whose noise scale is a fixed standard
deviation) and ``DDIMScheduler`` (a step with ``eta > 0``) have densities; a
scheduler that draws no noise, found by stepping copies of it with different
generators and global random states, has none to report; any other scheduler
is refused for ``"full"``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from diffusion_runtime.trajectory import gaussian_log_density


@attrs.frozen
class StepGaussian:
    """What a stochastic step draws ``x_{t-1}`` from: N(``mean``, ``std``² I), in float64."""

    mean: torch.Tensor
    std: float

    def log_density(self, drawn: torch.Tensor) -> torch.Tensor:
        """The log-density of ``drawn``, summed over each row's elements, in float64."""
        return gaussian_log_density(drawn, self.mean, self.std)


#: A scheduler's step Gaussian from ``(scheduler, model_output, t, x_t, step_kwargs)``;
#: ``None`` for a step that adds no noise.
Posterior = Callable[[Any, torch.Tensor, Any, torch.Tensor, Mapping[str, Any]], StepGaussian | None]

#: DDPM variance types whose step multiplies the noise by a standard deviation that
#: depends on the timestep alone. ``fixed_large_log`` scales it by the square root of a
#: log (not a standard deviation) and the learned types need the model's variance output.
_DDPM_VARIANCES = ("fixed_small", "fixed_small_log", "fixed_large")


def ddpm_posterior(
    scheduler: Any,
    model_output: torch.Tensor,
    t: Any,
    sample: torch.Tensor,
    step_kwargs: Mapping[str, Any],
) -> StepGaussian | None:
    """``DDPMScheduler.step``'s Gaussian (the DDPM paper's posterior, eq. 6-7, with the
    configured variance); none at ``t = 0``, which adds no noise."""
    if int(t) <= 0:
        return None
    prev_t = int(scheduler.previous_timestep(t))
    cumprod = scheduler.alphas_cumprod.double()
    a_t = cumprod[int(t)]
    a_prev = cumprod[prev_t] if prev_t >= 0 else torch.ones((), dtype=torch.float64)
    alpha = a_t / a_prev
    beta = 1 - alpha
    x = sample.double()
    x0 = _clean_estimate(scheduler, model_output.double(), x, a_t)[0]
    mean = (a_prev.sqrt() * beta / (1 - a_t)) * x0 + (alpha.sqrt() * (1 - a_prev) / (1 - a_t)) * x
    if scheduler.config.variance_type == "fixed_large":
        variance = beta
    else:
        variance = ((1 - a_prev) / (1 - a_t) * beta).clamp(min=1e-20)
    return StepGaussian(mean, float(variance.sqrt()))


def ddim_posterior(
    scheduler: Any,
    model_output: torch.Tensor,
    t: Any,
    sample: torch.Tensor,
    step_kwargs: Mapping[str, Any],
) -> StepGaussian | None:
    """``DDIMScheduler.step``'s Gaussian (the DDIM paper, eq. 12 and 16) for its ``eta``; none
    for ``eta = 0`` or a step whose noise scale is 0 (the last, when the schedule ends at
    ``alpha = 1``)."""
    eta = float(step_kwargs.get("eta", 0.0))
    if eta <= 0:
        return None
    prev_t = int(t) - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    cumprod = scheduler.alphas_cumprod.double()
    a_t = cumprod[int(t)]
    a_prev = cumprod[prev_t] if prev_t >= 0 else scheduler.final_alpha_cumprod.double()
    std = eta * float(((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt())
    if std == 0:
        return None
    x = sample.double()
    x0, eps = _clean_estimate(scheduler, model_output.double(), x, a_t)
    if step_kwargs.get("use_clipped_model_output"):
        eps = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
    mean = a_prev.sqrt() * x0 + (1 - a_prev - std**2).sqrt() * eps
    return StepGaussian(mean, std)


def _clean_estimate(
    scheduler: Any, output: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The predicted clean sample (thresholded or clipped as configured) and noise."""
    config = scheduler.config
    kind = config.prediction_type
    if kind == "epsilon":
        x0, eps = (x - (1 - a_t).sqrt() * output) / a_t.sqrt(), output
    elif kind == "sample":
        x0, eps = output, (x - a_t.sqrt() * output) / (1 - a_t).sqrt()
    elif kind == "v_prediction":
        x0 = a_t.sqrt() * x - (1 - a_t).sqrt() * output
        eps = a_t.sqrt() * output + (1 - a_t).sqrt() * x
    else:
        raise ValueError(f"prediction_type {kind!r} has no posterior here")
    if config.thresholding:
        x0 = scheduler._threshold_sample(x0)
    elif config.clip_sample:
        x0 = x0.clamp(-config.clip_sample_range, config.clip_sample_range)
    return x0, eps


@attrs.frozen
class StepDensities:
    """How one scheduler's steps get their log-probabilities.

    ``posterior`` is ``None`` for a scheduler that draws no noise (its steps have no
    density). ``refusal`` says why ``return_trajectory="full"`` cannot be served, for a
    scheduler that draws noise the adapter has no density for.
    """

    posterior: Posterior | None = None
    refusal: str | None = None

    def gaussian(
        self,
        scheduler: Any,
        model_output: torch.Tensor,
        t: Any,
        sample: torch.Tensor,
        step_kwargs: Mapping[str, Any],
    ) -> StepGaussian | None:
        """The Gaussian the step from ``sample`` at ``t`` will draw from (taken before the
        step, from the scheduler as the step sees it); ``None`` when it adds no noise."""
        if self.posterior is None:
            return None
        return self.posterior(scheduler, model_output, t, sample, step_kwargs)


_POSTERIORS: dict[str, Posterior] = {
    "DDPMScheduler": ddpm_posterior,
    "DDIMScheduler": ddim_posterior,
}


def step_densities(template: Any, min_steps: int = 1) -> StepDensities:
    """How steps of ``template`` (the pipeline's scheduler) are scored: by its posterior,
    not at all (it draws no noise), or refused."""
    cls = type(template)
    name = cls.__name__
    posterior = _POSTERIORS.get(name) if cls.__module__.startswith("diffusers.") else None
    if posterior is ddpm_posterior and template.config.variance_type not in _DDPM_VARIANCES:
        variance = template.config.variance_type
        return StepDensities(
            refusal=f"has no density for {name} with variance_type {variance!r} "
            f"(only {', '.join(_DDPM_VARIANCES)})"
        )
    if posterior is not None:
        return StepDensities(posterior)
    if draws_no_noise(template, min_steps):
        return StepDensities()
    return StepDensities(
        refusal=f"has no density for the noise {name} draws (it computes them for "
        f"{' and '.join(_POSTERIORS)}, and reports none for schedulers that draw no noise)"
    )


#: The schedule and latents of :func:`draws_no_noise`'s check.
_PROBE_STEPS = 4
_PROBE_SHAPE = (1, 4, 8, 8)


def draws_no_noise(template: Any, min_steps: int = 1) -> bool:
    """True when a short schedule on copies of ``template`` gives the same bits whatever
    the step's generator and torch's global random state (``eta`` 1 where the step takes
    one): a scheduler that fails the check, or raises, is taken to draw noise."""
    try:
        first, second = (_probe_run(template, max(_PROBE_STEPS, min_steps), s) for s in (1, 2))
    except Exception:
        return False
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _probe_run(template: Any, steps: int, seed: int) -> list[torch.Tensor]:
    scheduler = copy.deepcopy(template)
    scheduler.set_timesteps(steps)
    accepted = inspect.signature(scheduler.step).parameters
    kwargs: dict[str, Any] = {"eta": 1.0} if "eta" in accepted else {}
    if "generator" in accepted:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    inputs = torch.Generator().manual_seed(0)
    sample = torch.randn(_PROBE_SHAPE, generator=inputs)
    samples = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for t in scheduler.timesteps:
            model_output = torch.randn(_PROBE_SHAPE, generator=inputs)
            scheduler.scale_model_input(sample, t)
            sample = scheduler.step(model_output, t, sample, **kwargs).prev_sample
            samples.append(sample)
    return samples
