"""Small real pipelines for tests and benchmarks: deterministic, seeded, batch-independent.

They do real tensor work on the configured device, draw all randomness from
each request's own generator, and only use element-wise and spatial
operations, so a request's output is bit-identical alone or in any batch.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffusion_runtime.errors import DeviceFault, InvalidFieldError
from diffusion_runtime.pipelines.protocols import (
    PipelineRequest,
    StepRequestState,
    forward_by_steps,
)
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.trajectory import SampledOutput, gaussian_log_density
from diffusion_runtime.validation import fail

MAX_SIZE = 256


class SeededNoisePipeline:
    """A toy denoiser: seeded noise pulled step by step toward a pattern set by the prompt.

    The output depends on the prompt, the seed, the step count (or custom
    ``timesteps``), the guidance scale and ``extra_args["noise"]``, and on
    nothing else. With that noise
    ``s`` > 0 (at most 1), every step but the last adds ``s`` times standard
    normal noise from the request's generator and reports its log-density
    (``step_log_prob``), as a stochastic sampler does. It implements both the
    request-mode and the step-mode contracts; ``forward`` runs the step
    methods, so both modes give bit-identical images.
    """

    supports_request_batch = True
    supports_output_options = True
    #: Custom ``timesteps`` replace the countdown ``num_inference_steps, ..., 1``
    #: that weighs each step's pull.
    custom_schedules = frozenset({"timesteps"})

    def __init__(
        self,
        device: torch.device | str = "cpu",
        size: int = 16,
        channels: int = 3,
        supports_request_batch: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.size = size
        self.channels = channels
        self.supports_request_batch = supports_request_batch

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        if not isinstance(prompt, (str, int)) or isinstance(prompt, bool):
            fail(self, "prompt", "must be a str or an int", prompt)
        for field in ("height", "width"):
            value = getattr(params, field)
            if value is not None and value > MAX_SIZE:
                fail(self, field, f"must be at most {MAX_SIZE}", value)
        noise_scale(params)
        countdown(params)

    def warmup_request(self) -> tuple[Any, SamplingParams]:
        return "warm-up", SamplingParams(num_inference_steps=1, seed=0)

    def forward(
        self, batch: Sequence[PipelineRequest]
    ) -> Mapping[str, torch.Tensor | SampledOutput]:
        return forward_by_steps(self, batch)

    # -- step mode ----------------------------------------------------------------------

    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        params = request.params
        height, width = params.height or self.size, params.width or self.size
        shape = (params.num_outputs_per_prompt, self.channels, height, width)
        noise = torch.randn(shape, generator=request.generator, device=self.device)
        target = self._pattern(request.prompt, shape) * (1.0 + 0.1 * params.guidance_scale)
        return StepRequestState(
            request=request,
            latents=noise,
            timesteps=countdown(params),
            conditioning=target,
        )

    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        stacked = torch.cat([s.latents for s in states])
        targets = torch.cat([s.conditioning for s in states])
        pull = targets - stacked
        return list(torch.split(pull, [s.latents.shape[0] for s in states]))

    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None:
        pulled = _pulled(state.latents, model_output, state.timesteps[state.step_index])
        scale = noise_scale(state.request.params)
        if _draws_noise(state, scale):
            state.latents = torch.add(pulled, _step_noise(state), alpha=scale)
            state.step_log_prob = gaussian_log_density(state.latents, pulled, scale)
        else:
            state.latents = pulled
        state.step_index += 1

    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        return torch.sigmoid(state.latents)

    def preview(self, state: StepRequestState) -> torch.Tensor:
        """The image so far (streamed every ``preview_interval`` steps)."""
        return self.post_decode(state)

    def _pattern(self, prompt: Any, shape: tuple[int, int, int, int]) -> torch.Tensor:
        generator = torch.Generator(device=self.device).manual_seed(
            zlib.crc32(str(prompt).encode())
        )
        pattern = torch.randn((1, *shape[1:]), generator=generator, device=self.device)
        return pattern.expand(shape)


class FaultInjectingPipeline(SeededNoisePipeline):
    """:class:`SeededNoisePipeline` with faults chosen by words in the prompt.

    - ``"fail"``: the forward (or the step) raises ``RuntimeError``, failing
      every request it runs;
    - ``"bad-step"``: in step mode, this request's own scheduler step raises;
    - ``"missing"``: the forward omits this request's result;
    - ``"device-fault"``: raises :class:`DeviceFault` (kills the executor);
    - ``"gate"``: the forward or step sets :attr:`gate_entered` and blocks
      until :attr:`gate_release` is set, so a test can act while it runs.

    With ``batched_steps=True`` it also has the optional ``step_batch`` and
    ``post_decode_batch`` (so the runner takes its batched path), with the same
    images, bit for bit, and the same faults: a ``"bad-step"`` request's own
    step fails it alone there too, by leaving its step index where it was
    (``step_batch`` has no other way to fail one request without the rest).

    ``forward_batches`` and ``step_batches`` record the ids of every call.

    With ``weights=True`` the prompt's pattern passes through :class:`PatternGain`,
    a module with a parameter and a buffer, and :meth:`reload_weights` builds it
    again, so sleep level 2 drops and reloads real weights that outputs depend on.
    """

    GATE_TIMEOUT_S = 60.0

    def __init__(
        self, *args: Any, batched_steps: bool = False, weights: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.gain = PatternGain(self.device) if weights else None
        self.gate_entered = threading.Event()
        self.gate_release = threading.Event()
        self.forward_batches: list[list[str]] = []
        self.step_batches: list[list[str]] = []
        if batched_steps:
            # Instance attributes: the runner looks the optional methods up by name.
            self.step_batch = self._step_batch
            self.post_decode_batch = self._post_decode_batch

    def forward(
        self, batch: Sequence[PipelineRequest]
    ) -> Mapping[str, torch.Tensor | SampledOutput]:
        self.forward_batches.append([request.request_id for request in batch])
        self._inject([request.prompt for request in batch])
        results = dict(super().forward(batch))
        for request in batch:
            if "missing" in str(request.prompt):
                del results[request.request_id]
        return results

    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        self.step_batches.append([state.request_id for state in states])
        self._inject([state.request.prompt for state in states])
        return super().denoise_step(states)

    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None:
        if "bad-step" in str(state.request.prompt):
            raise ValueError("injected step failure")
        super().step_scheduler(state, model_output)

    def _step_batch(self, states: Sequence[StepRequestState]) -> None:
        """One step for every state: one denoiser call, then one scheduler step on the
        stacked latents of each group of states at the same timestep."""
        model_outputs = self.denoise_step(states)
        groups: dict[tuple[int, float, bool], list[int]] = {}
        for i, state in enumerate(states):
            if "bad-step" in str(state.request.prompt):
                continue  # its own step fails: it does not advance
            scale = noise_scale(state.request.params)
            key = (state.timesteps[state.step_index], scale, _draws_noise(state, scale))
            groups.setdefault(key, []).append(i)
        for (remaining, scale, noisy), rows in groups.items():
            latents = torch.cat([states[i].latents for i in rows])
            pull = torch.cat([model_outputs[i] for i in rows])
            stepped = _pulled(latents, pull, remaining)
            sizes = [states[i].latents.shape[0] for i in rows]
            log_probs: Sequence[torch.Tensor | None] = [None] * len(rows)
            if noisy:  # each request's noise from its own generator, in row order
                mean = stepped
                noise = torch.cat([_step_noise(states[i]) for i in rows])
                stepped = torch.add(mean, noise, alpha=scale)
                log_probs = torch.split(gaussian_log_density(stepped, mean, scale), sizes)
            parts = torch.split(stepped, sizes)
            for i, part, log_prob in zip(rows, parts, log_probs, strict=True):
                states[i].latents = part
                states[i].step_log_prob = log_prob
                states[i].step_index += 1

    def _post_decode_batch(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        decoded = torch.sigmoid(torch.cat([state.latents for state in states]))
        return list(torch.split(decoded, [state.latents.shape[0] for state in states]))

    def reload_weights(self) -> None:
        """Sleep level 2's wake: the weights again, from their source (the constructor)."""
        if self.gain is not None:
            self.gain = PatternGain(self.device)

    def _pattern(self, prompt: Any, shape: tuple[int, int, int, int]) -> torch.Tensor:
        pattern = super()._pattern(prompt, shape)
        return pattern if self.gain is None else self.gain(pattern)

    def _inject(self, prompts: list[Any]) -> None:
        words = " ".join(str(p) for p in prompts)
        if "gate" in words:
            self.gate_entered.set()
            if not self.gate_release.wait(self.GATE_TIMEOUT_S):
                raise TimeoutError("the test never released the gate")
        if "device-fault" in words:
            raise DeviceFault("injected device fault")
        if "fail" in words:
            raise RuntimeError("injected failure")


class PatternGain(torch.nn.Module):
    """A gain (a parameter) and an offset (a buffer) on the prompt's pattern."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((1,), 0.75, device=device))
        self.offset: torch.Tensor
        self.register_buffer("offset", torch.full((1,), 0.125, device=device))

    def forward(self, pattern: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return pattern * self.scale + self.offset


def noise_scale(params: SamplingParams) -> float:
    """The noise a testing pipeline's steps add (``extra_args["noise"]``, default 0), checked."""
    scale = params.extra_args.get("noise", 0.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale <= 1:
        rule = "must be a number in [0, 1]"
        raise InvalidFieldError("SeededNoisePipeline", "extra_args['noise']", rule, scale)
    return float(scale)


def countdown(params: SamplingParams) -> list[int]:
    """A testing pipeline's timesteps: its custom ``timesteps`` (whole numbers), checked,
    else ``num_inference_steps, ..., 1``."""
    if params.timesteps is None:
        return list(range(params.num_inference_steps, 0, -1))
    if not all(float(t).is_integer() for t in params.timesteps):
        rule = "must be whole numbers"
        raise InvalidFieldError("SeededNoisePipeline", "timesteps", rule, params.timesteps)
    return [int(t) for t in params.timesteps]


def _draws_noise(state: StepRequestState, scale: float) -> bool:
    """Whether the state's next step adds noise: every step but the last, when asked."""
    return scale > 0 and state.step_index + 1 < state.num_steps


def _step_noise(state: StepRequestState) -> torch.Tensor:
    generator = state.request.generator
    return torch.randn(state.latents.shape, generator=generator, device=generator.device)


def _pulled(latents: torch.Tensor, pull: torch.Tensor, remaining: int) -> torch.Tensor:
    """One scheduler step of :class:`SeededNoisePipeline`, element-wise and per image."""
    x = latents + pull * (1.0 / (remaining + 1))
    return (x + x.roll(1, dims=-1) + x.roll(1, dims=-2)) / 3.0


class NullPipeline:
    """Does almost nothing: a 1x1 image per output. Measures the runtime's own cost."""

    supports_request_batch = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._blank = torch.zeros((1, 1, 1, 1), device=self.device)

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        blank = self._blank
        return {
            r.request_id: blank
            if r.params.num_outputs_per_prompt == 1
            else blank.expand(r.params.num_outputs_per_prompt, -1, -1, -1)
            for r in batch
        }
