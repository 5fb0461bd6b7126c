"""The core's table of loaded adapters: the one place that decides eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from diffusion_runtime.errors import LoRAError
from diffusion_runtime.lora_request import LoRARequest


class AdapterTable:
    """Which adapters every worker holds, in least-recently-used order, and which are pinned.

    At most ``capacity`` (``EngineConfig.max_cpu_loras``) are loaded. Making
    room evicts the least recently used adapter that is neither pinned nor
    used by an active request; when there is none the load is refused.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        self._pinned: set[int] = set()

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._loaded

    def get(self, adapter_id: int) -> LoRARequest | None:
        return self._loaded.get(adapter_id)

    @property
    def ids(self) -> list[int]:
        """Loaded ids, least recently used first."""
        return list(self._loaded)

    def is_pinned(self, adapter_id: int) -> bool:
        return adapter_id in self._pinned

    def victims_for_one_more(self, in_use: Container[int]) -> list[int]:
        """The adapters to evict so one more fits (none or one); raise if none may go."""
        if len(self._loaded) < self.capacity:
            return []
        for adapter_id in self._loaded:
            if adapter_id not in self._pinned and adapter_id not in in_use:
                return [adapter_id]
        raise LoRAError(
            f"no room for another adapter: all {self.capacity} loaded adapters "
            "(EngineConfig.max_cpu_loras) are pinned or used by active requests"
        )

    def add(self, request: LoRARequest, evicted: list[int]) -> None:
        for victim in evicted:
            self.remove(victim)
        self._loaded[request.adapter_id] = request

    def remove(self, adapter_id: int) -> None:
        self._loaded.pop(adapter_id, None)
        self._pinned.discard(adapter_id)

    def touch(self, adapter_id: int) -> None:
        """Mark an adapter as just used."""
        self._loaded.move_to_end(adapter_id)

    def pin(self, adapter_id: int) -> None:
        self._pinned.add(adapter_id)
