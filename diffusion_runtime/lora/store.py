"""The worker's adapters: host copies of the loaded ones and the device slots.

Loading is two-phase so a collective add is all or nothing: every worker
first *stages* the adapter (reads and checks the file; nothing serves from
it), and only when every worker staged it does each *commit* it. A failed
add *aborts* the staged copies everywhere. Which adapter to evict is decided
by the core (:class:`~diffusion_runtime.lora.table.AdapterTable`) and passed
to :meth:`AdapterStore.commit`, so every worker keeps the same set.

:class:`WorkerAdapters` is that contract as a protocol: a pipeline whose
adapters do not live in :class:`AdapterSlots` (the diffusers adapter, which
loads them with diffusers' own LoRA loading) returns its own implementation
from ``enable_lora``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from diffusion_runtime.lora.layers import AdapterSlots
from diffusion_runtime.lora.weights import LoRAWeights, check_adapter_file, load_adapter
from diffusion_runtime.lora_request import LoRARequest


@runtime_checkable
class WorkerAdapters(Protocol):
    """A worker's adapters: what the worker's adapter calls drive (two-phase add)."""

    def check_file(self, path: str) -> None:
        """Raise :class:`~diffusion_runtime.lora.weights.AdapterFileError` unless ``path``
        looks loadable (cheap: admission calls it for adapters not loaded)."""

    def stage(self, request: LoRARequest) -> None:
        """Read and check the adapter; it serves nothing until :meth:`commit`."""

    def commit(self, adapter_id: int, evict: Iterable[int]) -> None:
        """Drop ``evict``, then make the staged adapter loaded."""

    def abort(self, adapter_id: int) -> None:
        """Drop a staged adapter (no-op if this worker never staged it)."""

    def remove(self, adapter_id: int) -> bool:
        """Drop a loaded adapter; whether it was loaded."""

    def loaded_ids(self) -> list[int]: ...

    def staged_ids(self) -> list[int]: ...

    def activate(self, adapter_ids: Iterable[int]) -> None:
        """Make the adapters a step or wave uses ready to serve."""


class AdapterStore:
    """Adapters in host memory on one worker, and the device slots they run from."""

    def __init__(self, slots: AdapterSlots) -> None:
        self.slots = slots
        self._loaded: dict[int, LoRAWeights] = {}
        self._staged: dict[int, LoRAWeights] = {}

    def check_file(self, path: str) -> None:
        """A header check of the adapter file format (:mod:`diffusion_runtime.lora.weights`)."""
        check_adapter_file(path)

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
