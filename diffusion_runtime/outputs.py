"""What callers receive for a request."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from diffusion_runtime.fsm import RequestStatus

if TYPE_CHECKING:
    from PIL import Image


def images_digest(images: torch.Tensor) -> str:
    """A fingerprint of an image tensor's bytes (what a delivery event carries)."""
    raw = images.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


@attrs.frozen(slots=True)
class RequestMetrics:
    """Seconds spent waiting, executing, and in total (admission to final output).

    ``stage_durations`` splits a request's time by :data:`STAGES`: ``queue``
    (admission to first scheduling, as ``queue_time_s``), then the worker's
    seconds of ``encode``, ``denoise`` and ``decode`` work for it, and
    ``transfer``: the rest of its waves' time as the core saw them (handing
    inputs to the workers and results back). A batched call counts in full
    for each request in it. ``peak_memory_mb`` is the highest memory
    high-water mark of the waves it ran in: the device's peak allocation on
    CUDA, the worker process's peak resident set on the CPU (``None`` where
    neither can be read). ``cached_steps`` counts the denoising steps that
    reused an earlier model output (a step cache, ``docs/caching.md``) and
    ``model_evaluations`` those that ran the model (a guided step counts once).
    See ``docs/outputs.md``.
    """

    queue_time_s: float
    execution_time_s: float
    total_time_s: float
    stage_durations: Mapping[str, float] = attrs.field(factory=dict)
    peak_memory_mb: float | None = None
    cached_steps: int = 0
    model_evaluations: int = 0


#: The keys of :attr:`RequestMetrics.stage_durations`, in the order a request meets them.
STAGES = ("queue", "encode", "denoise", "decode", "transfer")


@attrs.frozen(slots=True, repr=False)
class Trajectory:
    """The path a request's sampling took (``SamplingParams.return_trajectory``).

    ``latents`` is ``(num_steps + 1, N, ...)``: the initial latents, then the
    latents after each step, on the CPU. ``timesteps[i]`` is the timestep step
    ``i`` started from. With ``return_trajectory="full"``, ``log_probs`` is
    ``(len(log_prob_steps), N)``: the log-density (float, summed over each
    image's elements) of the sample that step ``log_prob_steps[k]`` drew given
    the latents before it. Steps that draw no noise (a deterministic sampler, or
    a DDIM last step that returns the clean estimate) have no density, so they
    are not in ``log_prob_steps``;
    ``log_probs`` is ``None`` when no step drew any, or when not asked for.

    A part of a trajectory (what a progress output carries with
    ``SamplingParams.stream_trajectory``) covers the steps from ``first_step``
    on: ``timesteps`` and ``latents`` are those steps' (the latents after each),
    and a part from step 0 starts with the initial latents, as a whole
    trajectory does. :meth:`join` puts parts together; :meth:`steps_from` cuts one.
    """

    latents: torch.Tensor
    timesteps: tuple[int, ...]
    log_probs: torch.Tensor | None = None
    log_prob_steps: tuple[int, ...] = ()
    first_step: int = 0

    def __repr__(self) -> str:
        steps = len(self.timesteps)
        drawn = "none" if self.log_probs is None else f"{len(self.log_prob_steps)} steps"
        where = f" from step {self.first_step}" if self.first_step else ""
        return (
            f"Trajectory({steps} steps{where}, latents {tuple(self.latents.shape)}, "
            f"log-probs {drawn})"
        )

    @property
    def end_step(self) -> int:
        """The step after this trajectory's (or part's) last."""
        return self.first_step + len(self.timesteps)

    @classmethod
    def join(cls, parts: Sequence[Trajectory]) -> Trajectory:
        """One trajectory of consecutive parts (each starts where the one before
        it ends); ``ValueError`` for none, or for a gap or an overlap."""
        if not parts:
            raise ValueError("joining needs at least one part")
        for before, after in itertools.pairwise(parts):
            if after.first_step != before.end_step:
                raise ValueError(
                    f"a part from step {after.first_step} cannot follow one that ends "
                    f"before step {before.end_step}"
                )
        log_probs = [part.log_probs for part in parts if part.log_probs is not None]
        return cls(
            latents=torch.cat([part.latents for part in parts]),
            timesteps=tuple(t for part in parts for t in part.timesteps),
            log_probs=torch.cat(log_probs) if log_probs else None,
            log_prob_steps=tuple(s for part in parts for s in part.log_prob_steps),
            first_step=parts[0].first_step,
        )

    def steps_from(self, step: int) -> Trajectory:
        """The part of this trajectory from ``step`` on (``step`` within
        ``[first_step, end_step]``): what a progress output streamed up to
        ``step`` leaves for the final output to complete."""
        if not self.first_step <= step <= self.end_step:
            raise ValueError(f"step {step} is outside [{self.first_step}, {self.end_step}]")
        if step == self.first_step:
            return self
        skip = step - self.first_step
        # The row of the latents after step ``step - 1`` is the last one left out.
        rows = skip + (1 if self.first_step == 0 else 0)
        kept = sum(s < step for s in self.log_prob_steps)
        log_probs = self.log_probs
        if log_probs is not None:
            log_probs = log_probs[kept:] if kept < len(log_probs) else None
        return Trajectory(
            latents=self.latents[rows:],
            timesteps=self.timesteps[skip:],
            log_probs=log_probs,
            log_prob_steps=self.log_prob_steps[kept:],
            first_step=step,
        )


@attrs.frozen(slots=True, repr=False)
class RequestOutput:
    """One output of one request.

    ``finished`` is False only for intermediate outputs of a streamed request.
    ``image_batch`` is a CPU float tensor ``(N, C, H, W)`` in ``[0, 1]``, or
    ``None`` unless the request completed (or an intermediate output carries a
    preview); :attr:`images` splits it per image. ``error`` explains an aborted
    or failed request. In step mode, ``step`` of ``num_steps`` is the progress
    when the output was made (a progress bar's numbers). A request that asked
    for ``output_type="latent"`` gets its final ``latents`` (``(N, ...)``, as
    the pipeline's sampler leaves them) instead of images, and one that asked
    for ``return_trajectory`` its :class:`Trajectory` (both on its final,
    completed output; with ``stream_trajectory``, each progress output also
    carries the part recorded since the previous one; see
    ``docs/outputs.md``). Its ``repr`` is one short line: the pixels are left
    out.
    """

    request_id: str
    status: RequestStatus
    finished: bool
    image_batch: torch.Tensor | None
    seed: int
    error: str | None = None
    metrics: RequestMetrics | None = None
    step: int | None = None
    num_steps: int | None = None
    latents: torch.Tensor | None = None
    trajectory: Trajectory | None = None

    def __repr__(self) -> str:
        parts = [f"{self.request_id!r}", self.status.name]
        if not self.finished:
            parts.append("intermediate")
        if self.step is not None:
            parts.append(f"step {self.step}/{self.num_steps}")
        if self.image_batch is not None:
            count, *shape = self.image_batch.shape
            parts.append(f"{count} image{'s' if count != 1 else ''} {tuple(shape)}")
        if self.latents is not None:
            parts.append(f"latents {tuple(self.latents.shape)}")
        if self.trajectory is not None:
            parts.append(f"trajectory of {len(self.trajectory.timesteps)} steps")
        parts.append(f"seed={self.seed}")
        if self.error is not None:
            parts.append(f"error={self.error!r}")
        return f"RequestOutput({', '.join(parts)})"

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.FINISHED_COMPLETED

    @property
    def images(self) -> list[torch.Tensor]:
        """One ``(C, H, W)`` tensor per image (empty when there are none)."""
        return [] if self.image_batch is None else list(self.image_batch.unbind(0))

    def pil_images(self) -> list[Image.Image]:
        """The images as 8-bit PIL images: grayscale, RGB or RGBA by channel count."""
        from PIL import Image

        result = []
        for image in self.images:
            array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            channels = array.shape[2]
            if channels == 1:
                result.append(Image.fromarray(array[:, :, 0], mode="L"))
            elif channels in (3, 4):
                result.append(Image.fromarray(array, mode="RGB" if channels == 3 else "RGBA"))
            else:
                raise ValueError(f"cannot show a {channels}-channel image as PIL")
        return result
