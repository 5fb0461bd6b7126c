"""The rendezvous of one Ray executor's actors for their ``torch.distributed`` group.

The executor serves a ``TCPStore`` on a free port of its own node; each actor
connects to it and joins the group with it. The store lives as long as the
executor: :meth:`GroupRendezvous.close` stops serving it at shutdown.
"""

from __future__ import annotations

import datetime

import attrs
import ray
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped


@attrs.frozen
class StoreAddress:
    """Where the actors find the store, and the group they form with it."""

    host: str
    port: int
    world_size: int
    timeout_s: float

    def join(self, rank: int, device: torch.device) -> None:
        """Join the group as ``rank`` (gloo on CPU, NCCL on CUDA). The timeout bounds
        every collective: a rank waiting on a lost peer fails its call."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = TCPStore(self.host, self.port, self.world_size, False, timeout=timeout)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=self.world_size,
            timeout=timeout,
        )


class GroupRendezvous:
    """A ``TCPStore`` served by this process on a free port for ``world_size`` actors."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store: TCPStore | None = TCPStore(
            host, 0, world_size, True, timeout=timeout, wait_for_workers=False
        )
        self.address = StoreAddress(host, self._store.port, world_size, timeout_s)

    def close(self) -> None:
        """Stop serving the store (its socket and server thread go with it). Idempotent."""
        self._store = None
