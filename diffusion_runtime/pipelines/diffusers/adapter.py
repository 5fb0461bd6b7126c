"""``DiffusersPipeline``: a diffusers pipeline object run in request mode and step mode."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusion_runtime.errors import InvalidFieldError, PipelineContractError
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.pipelines.diffusers.cached_denoiser import (
    cached_denoiser_output,
    step_cache_for,
)
from diffusion_runtime.pipelines.diffusers.family import Family
from diffusion_runtime.pipelines.diffusers.log_probs import StepDensities, step_densities
from diffusion_runtime.pipelines.diffusers.peft_adapters import PeftAdapters
from diffusion_runtime.pipelines.diffusers.scheduler_steps import seed_noise_sampler
from diffusion_runtime.pipelines.diffusers.schedules import (
    check_schedule,
    schedules_taken,
    set_schedule,
)
from diffusion_runtime.pipelines.diffusers.step_groups import StepGroup, group_blocks, plan_groups
from diffusion_runtime.pipelines.diffusers.step_probe import steps_stack_exactly
from diffusion_runtime.pipelines.diffusers.support import family_for
from diffusion_runtime.pipelines.parallel import ParallelContext
from diffusion_runtime.pipelines.protocols import (
    PipelineRequest,
    Prompt,
    StepRequestState,
    forward_by_steps,
)
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.trajectory import SampledOutput

_OWNER = "DiffusersPipeline"


class DiffusersPipeline:
    """Runs a supported diffusers pipeline inside the runtime, in request and step mode.

    The pipeline's denoising loop is split at step boundaries: ``prepare_encode``
    encodes the prompt, draws the initial latents from the request's own
    generator and gives the request its own copy of the pipeline's scheduler
    (diffusers schedulers are stateful); ``denoise_step`` calls the denoiser
    once for the stacked rows of every running request, whatever their step
    index, and applies classifier-free guidance per request;
    ``step_scheduler`` advances one request; ``post_decode`` decodes it.
    ``step_batch`` (what the runner calls) does both halves of a step for the
    whole batch, sharing one scheduler step among requests at the same step
    where that is exact (see :mod:`.step_probe`), and ``post_decode_batch``
    decodes the requests that finish together in one call. ``forward`` runs
    those same methods, so both modes give identical images.

    ``rows_per_call=None`` calls the denoiser once per step on all rows: a
    request that runs alone gets exactly diffusers' output, but CPU GEMM
    kernels depend on the row count, so batch mates move its pixels by
    rounding (about 1e-6). ``rows_per_call=R`` calls it on padded chunks of
    exactly ``R`` rows, so a request's images are bit-identical whatever it
    is batched with, and differ from diffusers' own output by that rounding.

    ``SamplingParams.timesteps`` and ``sigmas`` reach the scheduler's
    ``set_timesteps`` as diffusers' pipelines pass them, where it takes them
    (:attr:`custom_schedules`); elsewhere they are refused at admission.

    ``return_trajectory="full"`` gets each stochastic step's log-probability for
    ``DDPMScheduler`` and ``DDIMScheduler`` (``eta > 0``), none for a scheduler that
    draws no noise, and is refused for any other (see :mod:`.log_probs`).

    The pipeline object is moved to ``device``. See :data:`SUPPORTED_PIPELINES`.

    ``source``, when given, builds the same diffusers pipeline again (from the
    files it was loaded from): the adapter then has ``reload_weights()`` and
    can sleep at level 2 (``docs/operations.md``). Without it, level 1 only.

    ``enable_lora`` serves LoRA adapters through diffusers' own LoRA loading
    (peft), each row of a step with its own adapter (``docs/lora.md``).

    A family's :attr:`cache_backends` (the DiT: ``tea_cache`` and ``first_block``)
    are decided per request inside each step (:mod:`.cached_denoiser`,
    ``docs/caching.md``).

    The families that take guidance (DiT, Stable Diffusion) split each
    denoiser call between CFG-parallel ranks (``enable_parallel``); with
    ``rows_per_call`` their images are bit-identical to one rank's. A step
    in which a request caches runs every row on every rank (all ranks make
    the same cache decisions), unsplit. The DiT family also splits each row's
    tokens between the ranks of a sequence group (``ulysses_degree``,
    ``ring_degree``), within float rounding of one rank's output.
    """

    supports_request_batch = True
    supports_output_options = True

    def __init__(
        self,
        pipe: Any,
        device: torch.device | str = "cpu",
        *,
        rows_per_call: int | None = None,
        source: Callable[[], Any] | None = None,
    ) -> None:
        family_cls = family_for(pipe)
        if rows_per_call is not None and (
            isinstance(rows_per_call, bool)
            or not isinstance(rows_per_call, int)
            or rows_per_call < 1
        ):
            raise InvalidFieldError(
                _OWNER, "rows_per_call", "must be a positive int or None", rows_per_call
            )
        self.device = torch.device(device)
        self.rows_per_call = rows_per_call
        self._family: Family | None = family_cls(pipe.to(self.device), self.device)
        self._adapters: PeftAdapters | None = None
        self._parallel: ParallelContext | None = None
        #: The parallel degrees this pipeline takes (an instance attribute: it
        #: depends on the family, and the runtime looks it up by name).
        self.parallel_degrees = frozenset(
            {"cfg_parallel_size"} if family_cls.takes_guidance else set()
        ) | frozenset({"ulysses_degree", "ring_degree"} if family_cls.splits_sequence else set())
        if source is not None:
            # An instance attribute: the runtime looks the optional member up by name.
            self.reload_weights = lambda: self._reload(source)
        self._scheduler_template = copy.deepcopy(pipe.scheduler)
        #: The custom schedules the scheduler's ``set_timesteps`` takes, found as
        #: diffusers' ``retrieve_timesteps`` finds them (an instance attribute: the
        #: runtime looks it up by name).
        self.custom_schedules = schedules_taken(self._scheduler_template)
        #: Whether requests at the same step share one scheduler step (see :meth:`step_batch`).
        self.stacks_scheduler_steps = steps_stack_exactly(
            self._scheduler_template, self.family.min_inference_steps
        )

    @property
    def cache_backends(self) -> frozenset[str]:
        """The step caches the wrapped pipeline's family serves (``docs/caching.md``)."""
        return self.family.cache_backends

    @functools.cached_property
    def step_densities(self) -> StepDensities:
        """How the scheduler's steps get log-probabilities (``return_trajectory="full"``),
        found at the first request that asks, since a scheduler not known to this module
        is stepped on copies to find whether it draws noise."""
        return step_densities(self._scheduler_template, self.family.min_inference_steps)

    @property
    def family(self) -> Family:
        """The pipeline-specific half; raises once the pipeline is closed."""
        if self._family is None:
            raise RuntimeError(f"{_OWNER} is closed")
        return self._family

    def enable_lora(self, max_loras: int, max_rank: int) -> PeftAdapters:
        """Serve adapters loaded by the pipeline's own ``load_lora_weights`` machinery.

        Only pipelines with diffusers' UNet LoRA loader (``StableDiffusionPipeline``)
        take adapters; ``max_loras`` is enforced by the scheduler.
        """
        pipe = self.family.pipe
        if not (hasattr(pipe, "lora_state_dict") and hasattr(pipe, "load_lora_into_unet")):
            raise PipelineContractError(
                f"EngineConfig.max_loras needs a diffusers pipeline with a UNet LoRA loader "
                f"(load_lora_weights); {type(pipe).__name__} has none"
            )
        if self._adapters is not None:
            raise RuntimeError("adapters are already enabled on this pipeline")
        self._adapters = PeftAdapters(lambda: self.family.pipe, max_rank)
        return self._adapters

    def enable_parallel(self, context: ParallelContext) -> None:
        """Share each denoiser call with the other CFG ranks, and split its tokens
        over the sequence group (``docs/parallelism.md``)."""
        self._parallel = context
        self._split_family_sequence()

    def _split_family_sequence(self) -> None:
        """Hand the family the sequence split, if the context has one."""
        if self._parallel is not None and self._parallel.sequence is not None:
            self.family.enable_sequence(self._parallel.sequence)

    # -- request mode ------------------------------------------------------------------

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """Reject, naming the field, what the wrapped pipeline cannot serve."""
        self.family.validate(prompt, params)
        check_schedule(self._scheduler_template, params, self.family.owner)
        if params.return_trajectory == "full" and self.step_densities.refusal is not None:
            rule = f"'full' needs log-probabilities, and the adapter {self.step_densities.refusal}"
            raise InvalidFieldError(_OWNER, "return_trajectory", rule, params.return_trajectory)

    def warmup_request(self) -> tuple[Prompt, SamplingParams]:
        """A request of the fewest steps the scheduler runs, through the whole path."""
        family = self.family
        params = SamplingParams(num_inference_steps=family.min_inference_steps, seed=0)
        return family.warmup_prompt(), params

    @torch.no_grad()
    def forward(self, batch: Sequence[PipelineRequest]) -> dict[str, torch.Tensor | SampledOutput]:
        """Sample every request of ``batch`` together; images keyed by request id."""
        return forward_by_steps(self, batch)

    # -- step mode ---------------------------------------------------------------------

    @torch.no_grad()
    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        """Encode the prompt, draw the initial latents and set up the request's own scheduler."""
        family, params = self.family, request.params
        family.validate(request.prompt, params)
        scheduler = copy.deepcopy(self._scheduler_template)
        device = self.device if family.timesteps_on_device else None
        set_schedule(scheduler, params, device)
        latents, encoded = family.encode(request, scheduler, family.image_size(params))
        seed_noise_sampler(scheduler, request.generator)  # after the latents, as diffusers draws
        return StepRequestState(
            request=request,
            latents=latents,
            timesteps=list(scheduler.timesteps),
            scheduler=scheduler,
            conditioning=encoded,
            step_cache=step_cache_for(request.cache),
        )

    @torch.no_grad()
    def denoise_step(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """One denoiser call over all states' rows; each state's guided model output."""
        return self._denoise(plan_groups(states, stackable=False), {})

    @torch.no_grad()
    def step_scheduler(self, state: StepRequestState, model_output: torch.Tensor) -> None:
        """Advance one request by one step of its own scheduler."""
        _step_group(plan_groups([state], stackable=False)[0], model_output, self.step_densities)

    @torch.no_grad()
    def step_batch(self, states: Sequence[StepRequestState]) -> None:
        """One step for every state: one denoiser call, one scheduler step per group.

        Requests at the same step of the same schedule share a scheduler step on
        their stacked latents when the scheduler passed :func:`steps_stack_exactly`
        (each alone otherwise); the groups and their latents are kept in the
        ``InputBatch`` cache while the running set is unchanged.
        """
        cache: dict[str, Any] = getattr(states, "cache", {})
        groups: list[StepGroup] | None = cache.get("groups")
        if groups is None:
            groups = cache["groups"] = plan_groups(states, self.stacks_scheduler_steps)
        for group, model_output in zip(groups, self._denoise(groups, cache), strict=True):
            _step_group(group, model_output, self.step_densities)

    @torch.no_grad()
    def post_decode(self, state: StepRequestState) -> torch.Tensor:
        """The finished images, ``(N, C, H, W)`` in ``[0, 1]``."""
        if self.rows_per_call is not None and self.family.decodes_rows_alone:
            return self.post_decode_batch([state])[0]
        return self.family.decode(state.latents, state.request.generator)

    @torch.no_grad()
    def post_decode_batch(self, states: Sequence[StepRequestState]) -> list[torch.Tensor]:
        """Requests that finished together, decoded by one VAE call (chunks of ``rows_per_call``).

        Pipelines whose decoding takes the request's generator (Stable Diffusion)
        decode each request on its own.
        """
        family = self.family
        if not family.decodes_rows_alone:
            return [family.decode(state.latents, state.request.generator) for state in states]
        latents = torch.cat([state.latents for state in states])
        images = self._in_chunks(lambda rows: family.decode(rows, None), latents)
        return list(torch.split(images, [len(state.latents) for state in states]))

    @torch.no_grad()
    def preview(self, state: StepRequestState) -> torch.Tensor | None:
        """The decoded clean-image estimate, when the scheduler reports one."""
        x0: torch.Tensor | None = state.conditioning.x0
        return None if x0 is None else self.family.decode(x0, None)

    def close(self) -> None:
        """Drop the pipeline."""
        self._family = None

    def _reload(self, source: Callable[[], Any]) -> None:
        """Build the wrapped pipeline again from its source (after a level-2 sleep)."""
        family = self.family
        pipe = source()
        self._family = type(family)(pipe.to(self.device), self.device)
        self._split_family_sequence()
        if self._adapters is not None:  # the new pipeline gets the loaded adapters again
            self._adapters.reattach()

    def _denoise(self, groups: Sequence[StepGroup], cache: dict[str, Any]) -> list[torch.Tensor]:
        """Each group's guided model output, from one denoiser call over all groups' rows."""
        family = self.family
        inputs: list[torch.Tensor] = []
        times: list[torch.Tensor] = []
        for group in groups:
            lead = group.lead
            t = lead.timesteps[lead.step_index]
            x = group.latents
            if group.guidance is not None:
                x = torch.cat([x, x])
            if family.scales_model_input:
                x = lead.scheduler.scale_model_input(x, t)
            inputs.append(x)
            times.append(torch.as_tensor(t, device=self.device).reshape(1).expand(len(x)))
        if "rows" not in cache:
            cache["rows"] = _cat_or_none([group.rows for group in groups])
            cache["loras"] = _row_loras(groups) if self._adapters is not None else None
        x_all = inputs[0] if len(groups) == 1 else torch.cat(inputs)
        t_all = times[0] if len(groups) == 1 else torch.cat(times)
        if any(state.step_cache is not None for group in groups for state in group.states):
            output = cached_denoiser_output(
                groups,
                x_all,
                t_all,
                cache["rows"],
                family.run_denoiser,
                family.blocks(),
                self._in_chunks,
            )
        else:
            output = self._split_denoiser(groups, x_all, t_all, cache["rows"], cache["loras"])
        if len(groups) == 1:
            return [family.combine(output, groups[0].guidance)]
        parts = torch.split(output, [len(x) for x in inputs])
        return [
            family.combine(part, group.guidance) for group, part in zip(groups, parts, strict=True)
        ]

    def _split_denoiser(
        self,
        groups: Sequence[StepGroup],
        x: torch.Tensor,
        t: torch.Tensor,
        rows: torch.Tensor | None,
        loras: list[LoRARequest | None] | None,
    ) -> torch.Tensor:
        """The denoiser's output for every row. With a parallel context each rank
        computes the rows of its guidance branch (and its share of unguided
        requests) and gathers the others'; in chunks of ``rows_per_call`` a row's
        output does not depend on its batch mates, so every rank gets one rank's bits."""
        parallel = self._parallel
        if parallel is None or parallel.cfg_size == 1:
            return self._run_denoiser(x, t, rows, loras)

        def compute(indices: list[int]) -> torch.Tensor:
            if not indices:
                return self.family.no_output(x)
            index = torch.tensor(indices, device=x.device)
            return self._run_denoiser(
                x[index],
                t[index],
                None if rows is None else rows[index],
                None if loras is None else [loras[i] for i in indices],
            )

        return parallel.run_rows(parallel.row_owners(group_blocks(groups)), compute)

    def _run_denoiser(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        rows: torch.Tensor | None,
        loras: list[LoRARequest | None] | None = None,
    ) -> torch.Tensor:
        family = self.family
        if loras is not None and self._adapters is not None:
            return self._run_with_adapters(self._adapters, x, t, rows, loras)
        if rows is None:
            return self._in_chunks(lambda x_, t_: family.run_denoiser(x_, t_, None), x, t)
        return self._in_chunks(family.run_denoiser, x, t, rows)

    def _run_with_adapters(
        self,
        adapters: PeftAdapters,
        x: torch.Tensor,
        t: torch.Tensor,
        rows: torch.Tensor | None,
        loras: list[LoRARequest | None],
    ) -> torch.Tensor:
        """The denoiser with row ``i`` under adapter ``loras[i]``: one call per pass
        (see :meth:`PeftAdapters.passes`), each in chunks of ``rows_per_call``."""
        family = self.family

        def call(
            x_: torch.Tensor, t_: torch.Tensor, codes: torch.Tensor, *rows_: torch.Tensor
        ) -> torch.Tensor:
            with adapters.rows_using(codes):
                denoised: torch.Tensor = family.run_denoiser(x_, t_, rows_[0] if rows_ else None)
            return denoised

        extra = [] if rows is None else [rows]
        output: torch.Tensor | None = None
        for indices, codes in adapters.passes(loras):
            if indices is None:  # one pass over every row
                return self._in_chunks(call, x, t, codes, *extra)
            part = self._in_chunks(
                call, x[indices], t[indices], codes, *(r[indices] for r in extra)
            )
            if output is None:
                output = part.new_empty((len(x), *part.shape[1:]))
            output[indices] = part
        if output is None:
            raise RuntimeError("no denoiser pass ran")
        return output

    def _in_chunks(self, call: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        """``call(*tensors)``; with ``rows_per_call``, concatenated over padded chunks of it."""
        size = self.rows_per_call
        if size is None:
            return call(*tensors)
        count = len(tensors[0])
        padded = [_pad_rows(tensor, size) for tensor in tensors]
        chunks = [
            call(*(tensor[i : i + size] for tensor in padded))
            for i in range(0, len(padded[0]), size)
        ]
        return torch.cat(chunks)[:count]


def _step_group(group: StepGroup, model_output: torch.Tensor, densities: StepDensities) -> None:
    """One step of the group's lead scheduler over the group's stacked latents, with each
    row's log-probability when a member asked for them."""
    lead = group.lead
    t = lead.timesteps[lead.step_index]
    sample, kwargs = group.latents, group.step_kwargs
    gaussian = (
        densities.gaussian(lead.scheduler, model_output, t, sample, kwargs)
        if group.wants_log_probs
        else None
    )
    result = lead.scheduler.step(model_output, t, sample, **kwargs)
    log_prob = None if gaussian is None else gaussian.log_density(result.prev_sample)
    group.advance(result.prev_sample, getattr(result, "pred_original_sample", None), log_prob)


def _row_loras(groups: Sequence[StepGroup]) -> list[LoRARequest | None]:
    """Each denoiser row's adapter, in the order :meth:`DiffusersPipeline._denoise`
    stacks rows (a guided group's members twice: the first halves, then the second)."""
    loras: list[LoRARequest | None] = []
    for group in groups:
        once = [s.request.params.lora for s in group.states for _ in range(len(s.latents))]
        loras += once * (2 if group.guidance is not None else 1)
    return loras


def _cat_or_none(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``parts`` as one tensor, or ``None`` when any part is (an unconditional model)."""
    if any(part is None for part in parts):
        return None
    present = [part for part in parts if part is not None]
    return present[0] if len(present) == 1 else torch.cat(present)


def _pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """``tensor`` with its last row repeated up to a multiple of ``multiple`` rows."""
    pad = -len(tensor) % multiple
    if not pad:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(pad, *tensor.shape[1:])])
