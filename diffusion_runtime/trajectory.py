"""What a request gets back besides images: its final latents and its sampling trajectory.

A request asks with ``SamplingParams.output_type="latent"`` (the final latents,
not decoded) and ``SamplingParams.return_trajectory`` (``"latents"``: the
latents before the first step and after every step; ``"full"``: also the
log-probability of each step that drew noise). The runner records a step
state's trajectory in a :class:`TrajectoryRecorder`; a pipeline's request-mode
``forward`` returns a :class:`SampledOutput` for such a request (as
:func:`~diffusion_runtime.pipelines.protocols.forward_by_steps` does). See
``docs/outputs.md``.
"""

from __future__ import annotations

import math

import attrs
import torch


@attrs.define(eq=False)
class TrajectoryRecorder:
    """One request's trajectory, recorded step by step on its device.

    ``latents[0]`` is the initial latents, ``latents[i + 1]`` the latents after
    step ``i``. ``log_probs[k]`` (one value per image) is the log-density of the
    sample that step ``log_prob_steps[k]`` drew; steps that drew no noise have
    none. ``with_log_probs`` is False for ``return_trajectory="latents"``.
    ``taken`` counts the latents and log-probs that earlier parts
    (:meth:`take_part`, for ``SamplingParams.stream_trajectory``) held.
    """

    with_log_probs: bool
    latents: list[torch.Tensor] = attrs.field(factory=list)
    log_probs: list[torch.Tensor] = attrs.field(factory=list)
    log_prob_steps: list[int] = attrs.field(factory=list)
    taken: tuple[int, int] = (0, 0)

    def record(self, latents: torch.Tensor, step: int, log_prob: torch.Tensor | None) -> None:
        """Record the latents after ``step`` and, when asked for and drawn, its log-prob."""
        self.latents.append(latents.clone())
        if self.with_log_probs and log_prob is not None:
            self.log_probs.append(log_prob.detach().clone())
            self.log_prob_steps.append(step)

    def take_part(self, timesteps: tuple[int, ...]) -> TrajectoryTensors:
        """What was recorded since the previous part, stacked: the latents after each
        new step (preceded by the initial latents in the first part), those steps'
        ``timesteps`` and their log-probs."""
        latents_from, log_probs_from = self.taken
        self.taken = (len(self.latents), len(self.log_probs))
        new_log_probs = self.log_probs[log_probs_from:]
        return TrajectoryTensors(
            torch.stack(self.latents[latents_from:]),
            torch.stack(new_log_probs) if new_log_probs else None,
            timesteps[max(latents_from - 1, 0) : len(self.latents) - 1],
            tuple(self.log_prob_steps[log_probs_from:]),
        )

    def finish(self, timesteps: tuple[int, ...]) -> TrajectoryTensors:
        """The recorded trajectory, stacked."""
        log_probs = torch.stack(self.log_probs) if self.log_probs else None
        return TrajectoryTensors(
            torch.stack(self.latents), log_probs, timesteps, tuple(self.log_prob_steps)
        )


@attrs.frozen
class TrajectoryTensors:
    """A finished trajectory: ``latents`` ``(steps + 1, N, ...)``; ``log_probs``
    ``(len(log_prob_steps), N)`` or ``None``; the schedule's ``timesteps``."""

    latents: torch.Tensor
    log_probs: torch.Tensor | None
    timesteps: tuple[int, ...]
    log_prob_steps: tuple[int, ...]


@attrs.frozen
class SampledOutput:
    """What a pipeline returns for a request with output options: ``output`` is
    the images, or the final latents for ``output_type="latent"``; ``trajectory``
    is set when the request asked for one."""

    output: torch.Tensor
    trajectory: TrajectoryTensors | None = None


def gaussian_log_density(sample: torch.Tensor, mean: torch.Tensor, sigma: float) -> torch.Tensor:
    """The log-density of ``sample`` under N(``mean``, ``sigma``² I), summed over each
    row's elements (one value per row), in float64: what a stochastic step that drew
    ``sample = mean + sigma * noise`` reports as its ``step_log_prob``."""
    diff = (sample.double() - mean.double()).flatten(1)
    per_element = diff.square() / (-2 * sigma**2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)
    return per_element.sum(dim=1)
