"""Bugs in the LoRA layer that the ``lora`` target must catch: a row given
another row's adapter or scale, a device slot overwritten while its step
needs it, and eviction or removal that forgets pins or the requests using
an adapter. The oracle (the adapter merged into the weights) catches the
first kind; the harness's adapter checks and INV-013..015 the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Any

from diffusion_runtime.lora.control import AdapterControl
from diffusion_runtime.lora.layers import AdapterPlan, AdapterSlots
from diffusion_runtime.lora.table import AdapterTable
from diffusion_runtime.lora.weights import LoRAWeights
from diffusion_runtime.pipelines.digits.pipeline import DigitsPipeline
from diffusion_runtime.pipelines.protocols import StepRequestState
from diffusion_runtime.scheduler.adapter_budget import AdapterBudget
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace

#: A bug in how a step's rows get their adapters: each row's slots and scales in,
#: the slots and scales the bug gives them out.
RowRewrite = Callable[[list[int], list[float]], tuple[list[int], list[float]]]


def _rows_rewritten(rewrite: RowRewrite) -> Patch:
    def make(original: Any) -> Any:
        def row_adapters(
            self: DigitsPipeline, states: list[StepRequestState], copies: list[int]
        ) -> AdapterPlan | None:
            plan: AdapterPlan | None = original(self, states, copies)
            if plan is None:
                return None
            slots, row_slots, row_scales = plan
            return (slots, *rewrite(row_slots, row_scales))

        return row_adapters

    return _replace(DigitsPipeline, "_row_adapters", make)


def batch_mate_adapter_applied() -> Patch:
    def first_adapted_row(slots: list[int], scales: list[float]) -> tuple[list[int], list[float]]:
        adapted = [i for i, slot in enumerate(slots) if slot]
        if not adapted:
            return slots, scales
        first = adapted[0]  # "a step batch runs one adapter"
        return [slots[first]] * len(slots), [scales[first]] * len(slots)

    return _rows_rewritten(first_adapted_row)


def adapter_scale_ignored() -> Patch:
    def unit_scales(slots: list[int], scales: list[float]) -> tuple[list[int], list[float]]:
        return slots, [1.0 if slot else 0.0 for slot in slots]  # "folded into the weights"

    return _rows_rewritten(unit_scales)


def needed_slot_overwritten() -> Patch:
    def make(original: Any) -> Any:
        def activate(self: AdapterSlots, adapters: Mapping[int, LoRAWeights]) -> None:
            missing = [i for i in adapters if i not in self._slot_of]
            free = sorted(set(range(1, self.max_loras + 1)) - set(self._slot_of.values()))
            for adapter_id in missing:
                # "replace the least recently activated adapter"
                slot = free.pop(0) if free else self._slot_of.pop(next(iter(self._slot_of)))
                self._write(slot, adapters[adapter_id])
                self._slot_of[adapter_id] = slot
            for adapter_id in adapters:
                self._slot_of.move_to_end(adapter_id)

        return activate

    return _replace(AdapterSlots, "activate", make)


def in_use_adapter_evicted() -> Patch:
    def make(original: Any) -> Any:
        def victims(self: AdapterTable, in_use: Container[int]) -> list[int]:
            victims: list[int] = original(self, ())  # "requests hold their own copy"
            return victims

        return victims

    return _replace(AdapterTable, "victims_for_one_more", make)


def pin_ignored_by_eviction() -> Patch:
    def make(original: Any) -> Any:
        def victims(self: AdapterTable, in_use: Container[int]) -> list[int]:
            if len(self.ids) < self.capacity:
                return []
            for adapter_id in self.ids:  # "pins only keep an adapter from remove_lora"
                if adapter_id not in in_use:
                    return [adapter_id]
            victims: list[int] = original(self, in_use)
            return victims

        return victims

    return _replace(AdapterTable, "victims_for_one_more", make)


def in_use_adapter_removed() -> Patch:
    def make(original: Any) -> Any:
        def remove(self: AdapterControl, adapter_id: int) -> bool:
            in_use = self._in_use
            self._in_use = set  # "requests that use it will reload it on demand"
            try:
                removed: bool = original(self, adapter_id)
            finally:
                self._in_use = in_use
            return removed

        return remove

    return _replace(AdapterControl, "remove", make)


def adapter_budget_ignored() -> Patch:
    def make(original: Any) -> Any:
        def admits(self: AdapterBudget, request: Request) -> bool:
            lora = request.params.lora
            if lora is not None:
                self.ids.add(lora.adapter_id)  # "the workers make room as they go"
            return True

        return admits

    return _replace(AdapterBudget, "admits", make)


LORA_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="batch-mate-adapter", mode="step", target="lora",
             bug="every row of a step gets the first adapted row's adapter",
             patch=batch_mate_adapter_applied),
    Mutation(name="adapter-scale-ignored", mode="request", target="lora",
             bug="a request's adapter scale is ignored", patch=adapter_scale_ignored),
    Mutation(name="needed-slot-overwritten", mode="step", target="lora",
             bug="loading a step's adapter into a device slot evicts another adapter "
                 "the same step needs",
             patch=needed_slot_overwritten),
    Mutation(name="in-use-adapter-evicted", mode="step", target="lora",
             bug="eviction picks an adapter that active requests use",
             patch=in_use_adapter_evicted),
    Mutation(name="pin-ignored-by-eviction", mode="request", target="lora",
             bug="eviction ignores pins", patch=pin_ignored_by_eviction),
    Mutation(name="in-use-adapter-removed", mode="step", target="lora",
             bug="remove_lora unloads an adapter that active requests use",
             patch=in_use_adapter_removed),
    Mutation(name="adapter-budget-ignored", mode="step", target="lora",
             bug="a step holds more distinct adapters than max_loras",
             patch=adapter_budget_ignored),
)  # fmt: skip
