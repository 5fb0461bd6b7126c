"""The adapter limit of one wave: at most ``EngineConfig.max_loras`` distinct adapters."""

from __future__ import annotations

from collections.abc import Iterable

from diffusion_runtime.scheduler.request import Request


class AdapterBudget:
    """Counts the distinct adapters of a wave as requests are added to it.

    A step batch mixes adapters, but the workers hold only ``limit`` of them
    in device slots at once, so a wave may use no more.
    """

    def __init__(self, limit: int, members: Iterable[Request] = ()) -> None:
        self.limit = limit
        self.ids = {r.params.lora.adapter_id for r in members if r.params.lora is not None}

    def admits(self, request: Request) -> bool:
        """Whether ``request`` fits; if so, its adapter now counts."""
        lora = request.params.lora
        if lora is None or lora.adapter_id in self.ids:
            return True
        if len(self.ids) >= self.limit:
            return False
        self.ids.add(lora.adapter_id)
        return True
