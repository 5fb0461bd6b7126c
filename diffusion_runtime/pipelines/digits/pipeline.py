"""``DigitsPipeline``: class-conditional DDIM sampling of 8x8 handwritten digits."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.lora.layers import (
    AdapterPlan,
    AdapterSlots,
    attach_adapter_slots,
    install_adapter_slots,
)
from diffusion_runtime.pipelines.digits.cached_steps import (
    remember_predictions,
    reused_predictions,
)
from diffusion_runtime.pipelines.digits.model import (
    IMAGE_SIZE,
    PIXELS,
    DDIMScheduler,
    DenoiserConfig,
    DigitDenoiser,
    cosine_alpha_bars,
    ddim_timesteps,
)
from diffusion_runtime.pipelines.parallel import ParallelContext, RowBlock
from diffusion_runtime.pipelines.protocols import (
    PipelineRequest,
    Prompt,
    StepRequestState,
    forward_by_steps,
)
from diffusion_runtime.pipelines.step_cache import tea_cache_for
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.trajectory import SampledOutput

WEIGHTS_DIR = Path(__file__).parent
DENOISER_WEIGHTS = "denoiser.safetensors"
DENOISER_CONFIG = "denoiser.json"
MAX_GUIDANCE = 20.0
MAX_SIZE = 512
_DIGITS = "0123456789"
_OWNER = "DigitsPipeline"
# Rows per network call (see DigitDenoiser.predict_noise_row_stable): small on
# the CPU to keep single-request latency low, larger on accelerators.
_ROWS_PER_CALL = {"cpu": 32}
_ROWS_PER_CALL_DEFAULT = 256


def parse_digit(prompt: Prompt) -> int:
    """The digit a prompt asks for: an ``int`` 0-9 or a ``str`` "0"-"9" (whitespace stripped)."""
    if isinstance(prompt, int) and not isinstance(prompt, bool) and 0 <= prompt <= 9:
        return prompt
    if isinstance(prompt, str):
        text = prompt.strip()
        if len(text) == 1 and text in _DIGITS:
            return int(text)
    raise InvalidFieldError(_OWNER, "prompt", "must be a digit 0-9 (int or str)", prompt)


def output_size(params: SamplingParams) -> int:
    """The square output side for ``params`` (``None`` means the native 8)."""
    height = IMAGE_SIZE if params.height is None else params.height
    width = IMAGE_SIZE if params.width is None else params.width
    rule = f"must be a multiple of {IMAGE_SIZE} in [{IMAGE_SIZE}, {MAX_SIZE}]"
    for field, value in (("height", height), ("width", width)):
        if value % IMAGE_SIZE or not IMAGE_SIZE <= value <= MAX_SIZE:
            raise InvalidFieldError(_OWNER, field, rule, value)
    if height != width:
        raise InvalidFieldError(_OWNER, "width", "must equal height (square images only)", width)
    return height


class DigitsPipeline:
    """Class-conditional diffusion model of 8x8 digits (a residual MLP, ~1.3M parameters).

    Prompts are digits (``3`` or ``"3"``). Honours ``num_inference_steps``
    or custom ``timesteps`` (DDIM; ``extra_args={"eta": e}`` with ``e`` in [0, 1] makes its steps
    stochastic, default 0), ``guidance_scale`` (classifier-free guidance when > 1),
    ``num_outputs_per_prompt`` and square ``height``/``width`` (nearest-neighbour
    upscaling). All randomness comes from each request's generator, and every
    request's images are bit-identical whatever it is batched with.
    It serves the ``"tea_cache"`` step cache, decided per request
    (``docs/caching.md``); the first-block cache needs a network with blocks
    worth skipping alone, and this one is three small blocks.
    """

    supports_request_batch = True
    supports_output_options = True
    #: ``SamplingParams.timesteps``: integer training timesteps in ``[0, T - 1]``
    #: (no sigmas: the model knows only its discrete training timesteps).
    custom_schedules = frozenset({"timesteps"})
    cache_backends = frozenset({"tea_cache"})
    #: The ranks that share one model split each pass by guidance branch (``enable_parallel``).
    parallel_degrees = frozenset({"cfg_parallel_size"})

    def __init__(
        self, device: torch.device | str = "cpu", weights_dir: str | Path | None = None
    ) -> None:
        self.device = torch.device(device)
        self._root = WEIGHTS_DIR if weights_dir is None else Path(weights_dir)
        self.config = DenoiserConfig.load(self._root / DENOISER_CONFIG)
        self._model: DigitDenoiser | None = self._load_model()
        self._alpha_bars = tuple(cosine_alpha_bars(self.config.num_train_timesteps).tolist())
        self._rows_per_call = _ROWS_PER_CALL.get(self.device.type, _ROWS_PER_CALL_DEFAULT)
        self._adapter_slots: AdapterSlots | None = None
        self._parallel: ParallelContext | None = None

    def _load_model(self) -> DigitDenoiser:
        model = DigitDenoiser(self.config)
        state = load_file(str(self._root / DENOISER_WEIGHTS))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return model.to(self.device).eval().requires_grad_(False)

    def reload_weights(self) -> None:
        """Load the network again from its weights file (after a level-2 sleep)."""
        if self._model is None:
            raise RuntimeError("DigitsPipeline is closed")
        model = self._load_model()
        if self._adapter_slots is not None:  # the adapters keep their slots
            attach_adapter_slots(model, self._adapter_slots)
        self._model = model

    @property
    def model(self) -> DigitDenoiser:
        """The network; raises once the pipeline is closed."""
        if self._model is None:
            raise RuntimeError("DigitsPipeline is closed")
        return self._model

    def enable_lora(self, max_loras: int, max_rank: int) -> AdapterSlots:
        """Make every linear layer of the network adaptable (``docs/lora.md``).

        The runtime fills the returned slots before each step; each row of a
        step then gets its own request's adapter inside one network pass.
        """
        if self._adapter_slots is not None:
            raise RuntimeError("adapters are already enabled on this pipeline")
        self._adapter_slots = install_adapter_slots(self.model, max_loras, max_rank, self.device)
        return self._adapter_slots

    def _row_adapters(
        self, states: Sequence[StepRequestState], copies: Sequence[int]
    ) -> AdapterPlan | None:
        """Each network row's adapter slot and scale: ``copies[i]`` blocks of rows
        per state, in the order the rows are stacked (``None``: no adapters)."""
        slots = self._adapter_slots
        if slots is None:
            return None
        row_slots: list[int] = []
        row_scales: list[float] = []
        for state, count in zip(states, copies, strict=True):
            lora = state.request.params.lora
            rows = count * len(state.latents)
            row_slots += [0 if lora is None else slots.slot_of(lora.adapter_id)] * rows
            row_scales += [0.0 if lora is None else lora.scale] * rows
        return slots, row_slots, row_scales

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """Reject what this pipeline cannot serve, naming the field."""
        parse_digit(prompt)
        steps = params.num_inference_steps
        if params.timesteps is None and steps > self.config.num_train_timesteps:
            rule = f"must be at most {self.config.num_train_timesteps} (the training timesteps)"
            raise InvalidFieldError(_OWNER, "num_inference_steps", rule, steps)
        if params.guidance_scale > MAX_GUIDANCE:
            rule = f"must be at most {MAX_GUIDANCE}"
            raise InvalidFieldError(_OWNER, "guidance_scale", rule, params.guidance_scale)
        output_size(params)
        eta_of(params)
        self.schedule(params)

    def schedule(self, params: SamplingParams) -> list[int]:
        """The request's timesteps: its own ``timesteps`` (checked), else
        ``num_inference_steps`` evenly spaced ones."""
        train = self.config.num_train_timesteps
        if params.timesteps is None:
            return ddim_timesteps(params.num_inference_steps, train)
        if not all(t < train and float(t).is_integer() for t in params.timesteps):
            rule = f"must be whole numbers in [0, {train - 1}] (the training timesteps)"
            raise InvalidFieldError(_OWNER, "timesteps", rule, params.timesteps)
        return [int(t) for t in params.timesteps]

    def warmup_request(self) -> tuple[Prompt, SamplingParams]:
        """A cheap request that exercises the whole sampling path."""
        return "0", SamplingParams(num_inference_steps=2, seed=0)

    def forward(self, batch: Sequence[PipelineRequest]) -> dict[str, torch.Tensor | SampledOutput]:
        """Sample every request of ``batch`` as one fused batch; images keyed by request id."""
        return forward_by_steps(self, batch)

    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        """Draw the initial noise from the request's generator and set up its schedule."""
        digit = parse_digit(request.prompt)
        params = request.params
        count = params.num_outputs_per_prompt
        generator = request.generator
        noise = torch.randn(count, PIXELS, generator=generator, device=generator.device)
        timesteps = self.schedule(params)
        labels = torch.full((count,), digit, dtype=torch.long, device=self.device)
        return StepRequestState(
            request=request,
            latents=noise.to(self.device),
            timesteps=timesteps,
            scheduler=DDIMScheduler(self._alpha_bars, timesteps, eta_of(params)),
            conditioning=labels,
            step_cache=tea_cache_for(request.cache),
        )

    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """One network pass over the states (any step index) whose cache does not
        reuse its previous output; guided noise per state."""
        reused = reused_predictions(states)
        computing = [state for state in states if id(state) not in reused]
        computed = iter(self._noise(computing) if computing else [])
        outputs = [reused[id(state)] if id(state) in reused else next(computed) for state in states]
        remember_predictions(states, outputs)
        return outputs

    def _noise(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """One network pass over ``states``; guided noise per state."""
        xs: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        timesteps: list[int] = []
        rows: list[int] = []
        for state in states:
            copies = 2 if _guided(state) else 1
            xs += [state.latents] * copies
            labels.append(state.conditioning)
            if copies == 2:
                labels.append(torch.full_like(state.conditioning, self.config.null_class))
            rows.append(copies * len(state.latents))
            timesteps += [state.timesteps[state.step_index]] * rows[-1]
        t = torch.tensor(timesteps, dtype=torch.long, device=self.device)
        # Guided rows are stacked per state (cond copy, then uncond copy).
        adapters = self._row_adapters(states, [2 if _guided(s) else 1 for s in states])
        blocks = functools.partial(_state_blocks, states)
        eps = self._predict(torch.cat(xs), t, torch.cat(labels), adapters, blocks)
        outputs = []
        for state, part in zip(states, torch.split(eps, rows), strict=True):
            if _guided(state):
                cond, uncond = part.chunk(2)
                part = torch.lerp(uncond, cond, state.request.params.guidance_scale)
            outputs.append(part)
        return outputs

    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None:
        """Advance one request by one DDIM step."""
        scheduler: DDIMScheduler = state.scheduler
        noise = _step_noise(state) if scheduler.draws_noise(state.step_index) else None
        state.latents = scheduler.step(state.latents, model_output, state.step_index, noise)
        state.step_log_prob = scheduler.log_prob
        state.step_index += 1

    def step_batch(self, states: Sequence[StepRequestState]) -> None:
        """One step for every state: one network pass, one DDIM step per group.

        Requests at the same step of the same schedule with the same guidance
        form a group whose latents stay stacked while the running set is
        unchanged (in the ``InputBatch`` cache); the update is element-wise, so
        each row gets exactly what :meth:`step_scheduler` would give it.
        A state whose step cache reuses its previous output this step stays
        out of the network pass (``docs/caching.md``).
        """
        cache: dict[str, Any] = getattr(states, "cache", {})
        groups: list[_StepGroup] | None = cache.get("groups")
        if groups is None:
            groups = cache["groups"] = _plan_groups(states, self.config.null_class)
            cache["labels"] = torch.cat([group.labels for group in groups])
        reused = reused_predictions(states)
        if reused:  # the others run as one smaller batch
            parts = self._partly_reused_noise(groups, reused)
        else:
            parts = self._group_noise(groups, cache["labels"])
        for group, part in zip(groups, parts, strict=True):
            if any(state.step_cache is not None for state in group.states):
                sizes = [len(state.latents) for state in group.states]
                remember_predictions(group.states, torch.split(part, sizes))
            lead = group.lead
            noise = None
            if lead.scheduler.draws_noise(lead.step_index):  # each request's own draws
                noise = _cat([_step_noise(state) for state in group.states])
            group.advance(lead.scheduler.step(group.latents, part, lead.step_index, noise))

    def _partly_reused_noise(
        self, groups: list[_StepGroup], reused: dict[int, torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each group's guided noise, from the reused outputs of the states that
        skip the model and one network pass over the others."""
        computing = [state for g in groups for state in g.states if id(state) not in reused]
        computed = dict(reused)
        if computing:
            subgroups = _plan_groups(computing, self.config.null_class)
            labels = torch.cat([group.labels for group in subgroups])
            for group, part in zip(subgroups, self._group_noise(subgroups, labels), strict=True):
                sizes = [len(state.latents) for state in group.states]
                computed.update(
                    (id(s), p) for s, p in zip(group.states, torch.split(part, sizes), strict=True)
                )
        return [_cat([computed[id(state)] for state in group.states]) for group in groups]

    def _group_noise(self, groups: list[_StepGroup], labels: torch.Tensor) -> list[torch.Tensor]:
        """One network pass over every group's rows; each group's (guided) noise."""
        inputs = [torch.cat([g.latents, g.latents]) if g.guided else g.latents for g in groups]
        times = [
            torch.full((len(x),), g.lead.timesteps[g.lead.step_index], device=self.device)
            for g, x in zip(groups, inputs, strict=True)
        ]
        blocks = functools.partial(_group_blocks, groups)
        adapters = self._group_adapters(groups)
        eps = self._predict(_cat(inputs), _cat(times), labels, adapters, blocks)
        parts = [eps] if len(groups) == 1 else torch.split(eps, [len(x) for x in inputs])
        noise = []
        for group, part in zip(groups, parts, strict=True):
            if group.guided:
                cond, uncond = part.chunk(2)
                part = torch.lerp(uncond, cond, group.lead.request.params.guidance_scale)
            noise.append(part)
        return noise

    def enable_parallel(self, context: ParallelContext) -> None:
        """Share each network pass with the other ranks (``docs/parallelism.md``)."""
        self._parallel = context

    def _predict(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        labels: torch.Tensor,
        adapters: AdapterPlan | None,
        blocks: Callable[[], list[RowBlock]],
    ) -> torch.Tensor:
        """The network's noise for every row. With a parallel context each rank
        computes the rows of its guidance branch (and its share of unguided
        requests) and gathers the others: rows are computed row-stably, so
        every rank gets the bits one rank alone would."""
        parallel = self._parallel
        if parallel is None:
            return self.model.predict_noise_row_stable(x, t, labels, self._rows_per_call, adapters)

        def compute(rows: list[int]) -> torch.Tensor:
            if not rows:
                return x.new_empty((0, *x.shape[1:]))
            index = torch.tensor(rows, device=x.device)
            return self.model.predict_noise_row_stable(
                x[index], t[index], labels[index], self._rows_per_call, _rows_of(adapters, rows)
            )

        return parallel.run_rows(parallel.row_owners(blocks()), compute)

    def _group_adapters(self, groups: list[_StepGroup]) -> AdapterPlan | None:
        """Row adapters for :meth:`step_batch`: a guided group stacks all its
        states' rows twice (cond block, then uncond block)."""
        states = [state for g in groups for _ in range(2 if g.guided else 1) for state in g.states]
        return self._row_adapters(states, [1] * len(states))

    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        """The finished images, ``(N, 1, H, W)`` in ``[0, 1]``."""
        return self._to_images(state.latents, output_size(state.request.params))

    def post_decode_batch(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """:meth:`post_decode` of requests that finished together (element-wise, so stackable)."""
        sizes = {output_size(state.request.params) for state in states}
        if len(sizes) > 1:
            return [self.post_decode(state) for state in states]
        images = self._to_images(torch.cat([state.latents for state in states]), sizes.pop())
        return list(torch.split(images, [len(state.latents) for state in states]))

    def preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The current clean-image estimate, or ``None`` before the first step."""
        x0: torch.Tensor | None = state.scheduler.x0
        if x0 is None:
            return None
        return self._to_images(x0, output_size(state.request.params))

    def close(self) -> None:
        """Drop the network."""
        self._model = None

    @staticmethod
    def _to_images(x: torch.Tensor, size: int) -> torch.Tensor:
        images = ((x + 1) / 2).clamp(0.0, 1.0).reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE)
        scale = size // IMAGE_SIZE
        if scale > 1:
            images = images.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
        return images


def eta_of(params: SamplingParams) -> float:
    """The DDIM ``eta`` a request asks for in ``extra_args`` (default 0), checked."""
    eta = params.extra_args.get("eta", 0.0)
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0.0 <= eta <= 1.0:
        raise InvalidFieldError(_OWNER, "extra_args['eta']", "must be a number in [0, 1]", eta)
    return float(eta)


def _step_noise(state: StepRequestState) -> torch.Tensor:
    """A stochastic step's noise for one request, from its own generator."""
    generator = state.request.generator
    noise = torch.randn(state.latents.shape, generator=generator, device=generator.device)
    return noise.to(state.latents.device)


def _guided(state: StepRequestState) -> bool:
    return state.request.params.guidance_scale > 1.0


def _state_blocks(states: Sequence[StepRequestState]) -> list[RowBlock]:
    """The row blocks :meth:`DigitsPipeline.denoise_step` stacks: per state, its
    conditional and unconditional copies when guided, else one block."""
    blocks: list[RowBlock] = []
    for state in states:
        rows = len(state.latents)
        blocks += [(rows, 0), (rows, 1)] if _guided(state) else [(rows, None)]
    return blocks


def _group_blocks(groups: Sequence[_StepGroup]) -> list[RowBlock]:
    """The row blocks :meth:`DigitsPipeline.step_batch` stacks: per guided group,
    its conditional then unconditional rows; an unguided group by request."""
    blocks: list[RowBlock] = []
    for group in groups:
        if group.guided:
            blocks += [(len(group.latents), 0), (len(group.latents), 1)]
        else:
            blocks += [(len(state.latents), None) for state in group.states]
    return blocks


def _rows_of(adapters: AdapterPlan | None, rows: list[int]) -> AdapterPlan | None:
    if adapters is None:
        return None
    slots, row_slots, row_scales = adapters
    return slots, [row_slots[i] for i in rows], [row_scales[i] for i in rows]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@attrs.define(eq=False)
class _StepGroup:
    """Requests at the same step of the same schedule and guidance, with stacked latents."""

    states: list[StepRequestState]
    latents: torch.Tensor
    labels: torch.Tensor
    guided: bool

    @property
    def lead(self) -> StepRequestState:
        return self.states[0]

    def advance(self, latents: torch.Tensor) -> None:
        """Record a step: the lead scheduler's result goes to every member."""
        self.latents = latents
        lead = self.lead.scheduler
        if len(self.states) == 1:
            self.lead.latents = latents
            self.lead.step_log_prob = lead.log_prob
            self.lead.step_index += 1
            return
        sizes = [len(state.latents) for state in self.states]
        log_probs: Sequence[torch.Tensor | None] = (
            [None] * len(sizes) if lead.log_prob is None else torch.split(lead.log_prob, sizes)
        )
        for state, part, x0_part, log_prob in zip(
            self.states,
            torch.split(latents, sizes),
            torch.split(lead.x0, sizes),
            log_probs,
            strict=True,
        ):
            state.latents = part
            state.scheduler.x0 = x0_part
            state.step_log_prob = log_prob
            state.step_index += 1


def _plan_groups(states: Sequence[StepRequestState], null_class: int) -> list[_StepGroup]:
    members: dict[tuple[Any, ...], list[StepRequestState]] = {}
    for state in states:
        params = state.request.params
        eta = state.scheduler.eta
        schedule = (params.num_inference_steps, params.timesteps)
        key = (schedule, state.step_index, params.guidance_scale, eta)
        members.setdefault(key, []).append(state)
    groups = []
    for group in members.values():
        labels = torch.cat([state.conditioning for state in group])
        guided = _guided(group[0])
        if guided:
            labels = torch.cat([labels, torch.full_like(labels, null_class)])
        latents = _cat([state.latents for state in group])
        groups.append(_StepGroup(group, latents, labels, guided))
    return groups
