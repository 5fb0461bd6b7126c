"""The worker's adapters: host copies of the loaded ones and the device slots.

Loading is two-phase so a collective add is all or nothing: every worker
first *stages* the adapter (reads and checks the file; nothing serves from
it), and only when every worker staged it does each *commit* it. A failed
add *aborts* the staged copies everywhere. Which adapter to evict is decided
by the core (:class:`~diffusion_runtime.lora.table.AdapterTable`) and passed
to :meth:`AdapterStore.commit`, so every worker keeps the same set.
"""

from __future__ import annotations

from collections.abc import Iterable

from diffusion_runtime.lora.layers import AdapterSlots
from diffusion_runtime.lora.weights import LoRAWeights, load_adapter
from diffusion_runtime.lora_request import LoRARequest


class AdapterStore:
    """Adapters in host memory on one worker, and the device slots they run from."""

    def __init__(self, slots: AdapterSlots) -> None:
        self.slots = slots
        self._loaded: dict[int, LoRAWeights] = {}
        self._staged: dict[int, LoRAWeights] = {}

    def stage(self, request: LoRARequest) -> None:
        """Read and check the adapter's file; it serves nothing until :meth:`commit`."""
        self._staged[request.adapter_id] = load_adapter(
            request.path, self.slots.shapes, self.slots.max_rank
        )

    def commit(self, adapter_id: int, evict: Iterable[int]) -> None:
        """Drop ``evict``, then make the staged adapter loaded."""
        for victim in evict:
            self.remove(victim)
        self._loaded[adapter_id] = self._staged.pop(adapter_id)

    def abort(self, adapter_id: int) -> None:
        """Drop a staged adapter (no-op if this worker never staged it)."""
        self._staged.pop(adapter_id, None)

    def remove(self, adapter_id: int) -> bool:
        """Drop a loaded adapter and its device slot; whether it was loaded."""
        self.slots.forget(adapter_id)
        return self._loaded.pop(adapter_id, None) is not None

    def loaded_ids(self) -> list[int]:
        return sorted(self._loaded)

    def staged_ids(self) -> list[int]:
        return sorted(self._staged)

    def activate(self, adapter_ids: Iterable[int]) -> None:
        """Put the adapters a step or wave uses into device slots."""
        wanted = set(adapter_ids)
        missing = sorted(wanted - self._loaded.keys())
        if missing:
            raise RuntimeError(f"adapters {missing} are not loaded on this worker")
        self.slots.activate({adapter_id: self._loaded[adapter_id] for adapter_id in sorted(wanted)})
