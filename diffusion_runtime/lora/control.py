"""The core's adapter calls: each one a collective call that every worker applies.

An add is two-phase (stage everywhere, then commit everywhere; a failure
aborts the staged copies everywhere), so no worker is ever left with an
adapter the others lack. Calls run on the thread that drives the core,
between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from diffusion_runtime.errors import EngineDeadError, LoRAError
from diffusion_runtime.lora.table import AdapterTable
from diffusion_runtime.lora.weights import AdapterFileError
from diffusion_runtime.lora_request import LoRARequest

logger = logging.getLogger(__name__)

#: ``collective_rpc(method, args)``: the list of every worker's reply.
CollectiveCall = Callable[[str, tuple[Any, ...]], list[Any]]
#: Told each change of the table: ``(action, adapter_id)``, the action one of
#: ``loaded``, ``evicted``, ``removed``, ``pinned`` (the trace's ``AdapterEvent``).
TableChanged = Callable[[str, int], None]


class AdapterControl:
    """Adds, removes, pins and lists adapters across the workers of one core.

    ``in_use()`` returns the adapter ids of the active (waiting, running or
    preempted) requests: those are never evicted nor removed. ``changed`` is
    told every change of the table, once every worker has applied it.
    """

    def __init__(
        self,
        call: CollectiveCall,
        in_use: Callable[[], set[int]],
        capacity: int,
        changed: TableChanged,
    ) -> None:
        self._call = call
        self._in_use = in_use
        self._changed = changed
        self.table = AdapterTable(capacity)

    def add(self, request: LoRARequest) -> bool:
        """Load an adapter on every worker; False if its id is already loaded."""
        known = self.table.get(request.adapter_id)
        if known is not None:
            _check_same(known, request)
            return False
        victims = self.table.victims_for_one_more(self._in_use())
        try:
            self._call("stage_lora", (request,))
        except BaseException:
            self._abort_staged(request.adapter_id)
            raise
        self._call("commit_lora", (request.adapter_id, victims))
        self.table.add(request, victims)
        for victim in victims:
            logger.info("evicted adapter %d to load adapter %d", victim, request.adapter_id)
            self._changed("evicted", victim)
        self._changed("loaded", request.adapter_id)
        return True

    def ensure(self, request: LoRARequest) -> None:
        """Make a request's adapter loaded (on demand) and most recently used."""
        self.add(request)
        self.table.touch(request.adapter_id)

    def remove(self, adapter_id: int) -> bool:
        """Unload an adapter everywhere; False if it is not loaded.

        Raises :class:`LoRAError` while an active request uses it.
        """
        if adapter_id not in self.table:
            return False
        if adapter_id in self._in_use():
            raise LoRAError(
                f"adapter {adapter_id} is used by waiting, running or preempted requests; "
                "remove it once they have ended"
            )
        self._call("remove_lora", (adapter_id,))
        self.table.remove(adapter_id)
        self._changed("removed", adapter_id)
        return True

    def pin(self, adapter_id: int) -> bool:
        """Never evict this adapter; False if it is not loaded."""
        if adapter_id not in self.table:
            return False
        self.table.pin(adapter_id)
        self._changed("pinned", adapter_id)
        return True

    def list(self) -> list[int]:
        """The adapter ids loaded on the workers, merged and sorted."""
        replies: list[list[int]] = self._call("list_loras", ())
        return sorted(set().union(*replies))

    def check_loadable(self, request: LoRARequest) -> None:
        """For admission: raise :class:`AdapterFileError` if the adapter is loaded from
        another file. (Whether an adapter not loaded can be read is the workers' check:
        only the pipeline's adapters know their file format.)"""
        known = self.table.get(request.adapter_id)
        if known is not None:
            _check_same(known, request)

    def _abort_staged(self, adapter_id: int) -> None:
        try:
            self._call("abort_lora", (adapter_id,))
        except EngineDeadError:  # a dead executor holds nothing
            pass
        except Exception:  # keep the error that failed the add
            logger.exception("aborting the staged adapter %d failed", adapter_id)


def _check_same(known: LoRARequest, request: LoRARequest) -> None:
    if known.path != request.path:
        raise AdapterFileError(
            f"adapter {request.adapter_id} is loaded from {known.path!r}, not {request.path!r}"
        )
