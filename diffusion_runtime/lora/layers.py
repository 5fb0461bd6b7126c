"""Many adapters in one forward: device slots and the batched LoRA linear layer.

The idea of punica's and S-LoRA's multi-adapter kernels, written with two
batched matmuls over gathered weights: each row ``i`` of a batch gathers the
``A``/``B`` of its slot and gets ``scale_i * B_i @ (A_i @ x_i)`` added to the
base layer's output. Slot 0 holds zeros (rows without an adapter). Every
adapter is zero-padded to ``max_rank``, so the matmul shapes depend only on
the number of rows, never on which adapters share the batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import attrs
import torch
from torch import nn

from diffusion_runtime.lora.weights import LayerShapes, LoRAWeights


@attrs.frozen(eq=False)
class RowAdapters:
    """For one forward: each row's slot ``(N,)`` and scale ``(N,)``."""

    slots: torch.Tensor
    scales: torch.Tensor


class AdapterSlots:
    """``max_loras`` device slots for adapters, filled from host memory as steps need them.

    A slot's adapter stays until the slot is needed for another adapter: the
    least recently activated one not needed by the current step is replaced.
    """

    def __init__(
        self, shapes: LayerShapes, max_loras: int, max_rank: int, device: torch.device
    ) -> None:
        self.shapes = dict(shapes)
        self.device = device
        self.max_loras = max_loras
        self.max_rank = max_rank
        count = max_loras + 1
        self.a = {
            name: torch.zeros(count, fan_in, max_rank, device=device)
            for name, (fan_in, _) in shapes.items()
        }
        self.b = {
            name: torch.zeros(count, max_rank, fan_out, device=device)
            for name, (_, fan_out) in shapes.items()
        }
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self.rows: RowAdapters | None = None

    def slot_of(self, adapter_id: int | None) -> int:
        """The slot of an activated adapter; 0 (no update) for ``None``."""
        return 0 if adapter_id is None else self._slot_of[adapter_id]

    @property
    def active_ids(self) -> list[int]:
        return list(self._slot_of)

    def activate(self, adapters: Mapping[int, LoRAWeights]) -> None:
        """Make every adapter of ``adapters`` resident, evicting least recently used ones."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(
                f"a step needs {len(adapters)} adapters; EngineConfig.max_loras is {self.max_loras}"
            )
        missing = [adapter_id for adapter_id in adapters if adapter_id not in self._slot_of]
        for adapter_id in adapters:
            if adapter_id in self._slot_of:
                self._slot_of.move_to_end(adapter_id)
        free = sorted(set(range(1, self.max_loras + 1)) - set(self._slot_of.values()))
        for adapter_id in missing:
            if free:
                slot = free.pop(0)
            else:
                victim = next(i for i in self._slot_of if i not in adapters)
                slot = self._slot_of.pop(victim)
            self._write(slot, adapters[adapter_id])
            self._slot_of[adapter_id] = slot

    def forget(self, adapter_id: int) -> None:
        """Drop an adapter's slot (the adapter left host memory)."""
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            for name in self.a:
                self.a[name][slot].zero_()
                self.b[name][slot].zero_()

    @contextmanager
    def rows_using(self, rows: RowAdapters | None) -> Iterator[None]:
        """Apply ``rows`` to every batched layer during one forward."""
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None

    def _write(self, slot: int, weights: LoRAWeights) -> None:
        rank = weights.rank
        for name in self.a:
            a_slot, b_slot = self.a[name][slot], self.b[name][slot]
            a_slot.zero_()
            b_slot.zero_()
            pair = weights.layers.get(name)
            if pair is not None:
                a, b = pair
                a_slot[:, :rank].copy_(a.t())
                b_slot[:rank].copy_(b.t())


class BatchedLoRALinear(nn.Module):
    """An ``nn.Linear`` that adds each row's adapter update (see :class:`AdapterSlots`)."""

    def __init__(self, base: nn.Linear, name: str, slots: AdapterSlots) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.slots = slots  # shared by every layer; not a module, so not registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        slots = self.slots
        rows = slots.rows
        if rows is None:
            return y
        a = slots.a[self.name][rows.slots]
        b = slots.b[self.name][rows.slots]
        update = torch.bmm(torch.bmm(x.unsqueeze(1), a), b).squeeze(1)
        return y + update * rows.scales.unsqueeze(1)


#: A forward's adapters: the slots, and each row's slot and scale (as Python lists).
AdapterPlan = tuple[AdapterSlots, list[int], list[float]]


def install_adapter_slots(
    model: nn.Module, max_loras: int, max_rank: int, device: torch.device
) -> AdapterSlots:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`BatchedLoRALinear`
    sharing one new :class:`AdapterSlots`, and return the slots."""
    shapes = {name: (m.in_features, m.out_features) for name, m in _linears(model).items()}
    slots = AdapterSlots(shapes, max_loras, max_rank, device)
    attach_adapter_slots(model, slots)
    return slots


def attach_adapter_slots(model: nn.Module, slots: AdapterSlots) -> None:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`BatchedLoRALinear`
    over ``slots`` (as when the network is loaded again under the same slots)."""
    for name, linear in _linears(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, BatchedLoRALinear(linear, name, slots))


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
