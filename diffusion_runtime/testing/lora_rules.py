"""The core harness with LoRA adapters: requests ask for adapters drawn from a
small pool of random adapter files, and rules add, remove and pin adapters
while requests wait and run.

With fewer host slots (``max_cpu_loras``) than adapters in the pool, loading
on demand evicts; with fewer device slots (``max_loras``) than adapters,
steps hold requests back. The harness follows the adapter table from the
trace's :class:`~diffusion_runtime.fsm.events.AdapterEvent`\\ s and checks,
after every rule, that every worker holds exactly the adapters the trace
loaded, that pinned adapters and the adapters of active requests are among
them, and that ``add_lora``/``remove_lora``/``pin_lora`` answer as the
documented rules say. Each completed request is compared with the network
with its adapter merged in (:class:`~.lora_oracle.MergedAdapterOracle`); the
auditor's INV-013..015 judge the same rules from the trace.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import invariant, precondition, rule

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.errors import LoRAError
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.fsm.events import AdapterEvent, TraceEvent, WaveEvent
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.digits.model import DenoiserConfig, DigitDenoiser
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.testing.adapter_files import linear_shapes, write_random_adapter
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine
from diffusion_runtime.testing.harness_root import configured
from diffusion_runtime.testing.lora_oracle import MERGED_TOLERANCE, MergedAdapterOracle

#: The scales requests draw: 1.0, and two that a bug ignoring the scale cannot match.
SCALES = (0.5, 1.0, 2.0)
#: The ranks of the pool's adapters, in turn (padding to ``max_lora_rank`` varies).
RANKS = (4, 2, 8, 4)
_ACTIVE = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


class AdapterCoreLifecycleMachine(CoreLifecycleMachine):
    """The core harness over an engine with adapters; build one with
    :func:`adapter_lifecycle_machine`."""

    #: The pool requests and rules draw from (scale 1.0; requests draw a scale).
    adapters: ClassVar[tuple[LoRARequest, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        #: Loaded adapter ids, as the trace's adapter events tell them.
        self.loaded: set[int] = set()
        #: Adapters this harness pinned (a pin lasts until ``remove_lora``).
        self.pinned: set[int] = set()

    @functools.cached_property
    def oracle(self) -> MergedAdapterOracle:
        return MergedAdapterOracle(self.config)

    def tolerance_for(self, params: SamplingParams) -> float:
        return MERGED_TOLERANCE if params.lora is not None else super().tolerance_for(params)

    def check_against_the_pipeline(
        self, output: RequestOutput, prompt: Any, params: SamplingParams, seed: int
    ) -> None:
        super().check_against_the_pipeline(output, prompt, params, seed)
        if params.lora is not None:
            self.reach.note("path: a request with an adapter matched its merged network")

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def add_lora(self, data: st.DataObject) -> None:
        """Loads a pool adapter (see :meth:`_add_lora`)."""
        self._add_lora(data.draw(st.sampled_from(self.adapters), label="adapter"))

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def pin_then_load_the_others(self, data: st.DataObject) -> None:
        """Loads and pins an adapter, then loads every other pool adapter: with
        fewer host slots than adapters, loading evicts, and never the pinned one."""
        first = data.draw(st.sampled_from(self.adapters), label="adapter")
        self._add_lora(first)
        if self.core.pin_lora(first.adapter_id):
            self.pinned.add(first.adapter_id)
            self.reach.note("rule: pin, then load the others")
        for lora in self.adapters:
            if lora is not first:
                self._add_lora(lora)

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def remove_lora(self, data: st.DataObject) -> None:
        """Unloads a pool adapter (see :meth:`_remove_lora`)."""
        self._remove_lora(data.draw(st.sampled_from(self.adapters), label="adapter").adapter_id)

    @precondition(lambda self: self._alive and self._in_use())
    @rule(data=st.data())
    def remove_an_adapter_in_use(self, data: st.DataObject) -> None:
        """Unloads the adapter of a waiting, running or preempted request: refused."""
        self._remove_lora(data.draw(st.sampled_from(sorted(self._in_use())), label="in use"))

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def pin_lora(self, data: st.DataObject) -> None:
        """Pins an adapter: True exactly when it is loaded."""
        adapter_id = data.draw(st.sampled_from(self.adapters), label="adapter").adapter_id
        was_loaded = adapter_id in self.loaded
        pinned = self.core.pin_lora(adapter_id)
        assert pinned is was_loaded, f"pin_lora({adapter_id}) = {pinned}; loaded: {was_loaded}"
        if pinned:
            self.pinned.add(adapter_id)
            self.reach.note("adapter: pinned")

    @precondition(lambda self: self._alive)
    @rule(data=st.data())
    def add_mixed_adapters(self, data: st.DataObject) -> None:
        """Requests alike but for their adapters (distinct ones, or none) arrive
        together and a step runs, so in step mode they share a step batch."""
        base = attrs.evolve(data.draw(self.params), lora=None)
        choices = data.draw(
            st.lists(st.sampled_from((None, *self.adapters)), min_size=2, max_size=3, unique=True),
            label="adapters",
        )
        for lora in choices:
            scale = data.draw(st.sampled_from(SCALES), label="scale")
            adapter = None if lora is None else attrs.evolve(lora, scale=scale)
            self._add(data, data.draw(self.prompts), attrs.evolve(base, lora=adapter), False)
        self.reach.note("rule: requests with mixed adapters")
        self._step()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def workers_hold_the_adapters_the_trace_loaded(self) -> None:
        """Every worker holds exactly the adapters the trace loaded, no more than
        ``max_cpu_loras``, and none staged; pinned adapters and those of active
        requests among them."""
        if not self._alive:
            return
        expected = sorted(self.loaded)
        per_rank: list[list[int]] = self.core.collective_rpc("list_loras")
        staged: list[list[int]] = self.core.collective_rpc("staged_lora_ids")
        for rank, ids in enumerate(per_rank):
            assert ids == expected, f"rank {rank} holds adapters {ids}; the trace loaded {expected}"
            assert not staged[rank], f"rank {rank} keeps staged adapters {staged[rank]}"
        listed = self.core.list_loras()
        assert listed == expected, f"list_loras() = {listed}; the trace loaded {expected}"
        assert len(expected) <= self.config.lora_capacity, expected
        assert self.pinned <= self.loaded, f"pinned {sorted(self.pinned)}, loaded {expected}"
        in_use = self._in_use()
        assert in_use <= self.loaded, f"adapters in use {sorted(in_use)}, loaded {expected}"

    # -- the trace ---------------------------------------------------------------------

    def _record(self, event: TraceEvent) -> None:
        super()._record(event)
        if isinstance(event, AdapterEvent):
            self._adapter_event(event)
        elif isinstance(event, WaveEvent):
            self._note_wave_adapters(event)

    def _adapter_event(self, event: AdapterEvent) -> None:
        if event.action == "loaded":
            self.loaded.add(event.adapter_id)
        elif event.action in ("evicted", "removed"):
            self.loaded.discard(event.adapter_id)
        elif event.action == "refused" and event.request_id is not None:
            # No room for its adapter: it ends with an error and no lifecycle.
            record = self.records[event.request_id]
            record.refused = record.failing = True
            self.queued.discard(event.request_id)
            self.abort_due.discard(event.request_id)
        if event.action not in ("loaded", "used"):
            self.reach.note(f"adapter: {event.action}")

    def _note_wave_adapters(self, wave: WaveEvent) -> None:
        adapters = set()
        for rid in wave.scheduled_ids:
            record = self.records.get(rid)
            if record is not None:
                lora = record.params.lora
                adapters.add(None if lora is None else lora.adapter_id)
        if len(adapters - {None}) > 1:
            self.reach.note("path: a wave of two adapters")
        if None in adapters and len(adapters) > 1:
            self.reach.note("path: a wave of an adapter and the base model")

    # -- helpers -----------------------------------------------------------------------

    def _remove_lora(self, adapter_id: int) -> None:
        """``remove_lora``: refused while an active request uses the adapter; False
        if it is not loaded."""
        in_use, was_loaded = adapter_id in self._in_use(), adapter_id in self.loaded
        try:
            removed = self.core.remove_lora(adapter_id)
        except LoRAError:
            assert in_use, f"remove_lora({adapter_id}) refused, yet no active request uses it"
            self.reach.note("adapter: remove_lora refused while in use")
            return
        assert not in_use, f"adapter {adapter_id} removed while active requests use it"
        assert removed is was_loaded, f"remove_lora({adapter_id}) = {removed}; loaded: {was_loaded}"
        self.pinned.discard(adapter_id)
        self.reach.note(f"adapter: remove_lora {'unloaded' if removed else 'of an unloaded one'}")

    def _add_lora(self, lora: LoRARequest) -> None:
        """``add_lora``: False if loaded; refused only when every loaded adapter is
        pinned or in use and no host slot is free."""
        adapter_id = lora.adapter_id
        was_loaded, room = adapter_id in self.loaded, self._room()
        try:
            added = self.core.add_lora(lora)
        except LoRAError as exc:
            assert not was_loaded and not room, (
                f"add_lora({adapter_id}) refused ({exc}); loaded {sorted(self.loaded)}, "
                f"pinned {sorted(self.pinned)}, in use {sorted(self._in_use())}"
            )
            self.reach.note("adapter: add_lora refused, no room")
            return
        assert added is not was_loaded, f"add_lora({adapter_id}) = {added}; loaded: {was_loaded}"
        self.reach.note(f"adapter: add_lora {'loaded' if added else 'of a loaded adapter'}")

    def _in_use(self) -> set[int]:
        """Adapters of the admitted requests that are waiting, running or preempted."""
        return {
            record.params.lora.adapter_id
            for rid, record in self.records.items()
            if record.params.lora is not None
            and self.states.get(rid) in _ACTIVE
            and rid not in self.queued
        }

    def _room(self) -> bool:
        """Whether one more adapter can be loaded (a free host slot, or one to evict)."""
        busy = self.pinned | self._in_use()
        return len(self.loaded) < self.config.lora_capacity or bool(self.loaded - busy)


def digits_adapter_pool(count: int = len(RANKS)) -> tuple[LoRARequest, ...]:
    """``count`` random adapters for the digits network (ids 1..count), written to a
    temporary folder that is removed when the process exits."""
    directory = Path(tempfile.mkdtemp(prefix="diffusion-runtime-adapters-"))
    atexit.register(shutil.rmtree, directory, True)
    shapes = linear_shapes(DigitDenoiser(DenoiserConfig()))
    pool = []
    for adapter_id in range(1, count + 1):
        path = directory / f"adapter-{adapter_id}.safetensors"
        write_random_adapter(path, shapes, seed=adapter_id, rank=RANKS[(adapter_id - 1) % 4])
        pool.append(LoRARequest(f"adapter-{adapter_id}", adapter_id, str(path)))
    return tuple(pool)


def with_adapters(
    params: st.SearchStrategy[SamplingParams], pool: tuple[LoRARequest, ...]
) -> st.SearchStrategy[SamplingParams]:
    """``params`` with an adapter of ``pool`` (or none) at a drawn scale."""

    def attach(p: SamplingParams, lora: LoRARequest | None, scale: float) -> SamplingParams:
        return attrs.evolve(p, lora=None if lora is None else attrs.evolve(lora, scale=scale))

    return st.builds(attach, params, st.sampled_from((None, *pool)), st.sampled_from(SCALES))


def adapter_lifecycle_machine(
    config: Callable[[], EngineConfig],
    pool: tuple[LoRARequest, ...],
    params: st.SearchStrategy[SamplingParams],
    **options: Any,
) -> type[AdapterCoreLifecycleMachine]:
    """An adapter harness class for engines built from ``config()`` (``max_loras`` > 0),
    its requests drawn from ``params`` with adapters of ``pool``; ``options`` as
    :func:`~diffusion_runtime.testing.core_harness.core_lifecycle_machine` takes them."""
    return configured(
        AdapterCoreLifecycleMachine,
        "ConfiguredAdapterLifecycle",
        config,
        adapters=pool,
        params=with_adapters(params, pool),
        **options,
    )
