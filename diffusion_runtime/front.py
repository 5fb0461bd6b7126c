"""Front: the asynchronous request API that every front offers.

:class:`~diffusion_runtime.engine.DiffusionEngine` (in process),
:class:`~diffusion_runtime.stage.StageClient` (an engine core in a child
process) and :class:`~diffusion_runtime.replicas.ReplicaSet` (engines in Ray
actors) all admit a request, stream its outputs and abort it the same way;
code that needs no more than that (the HTTP images route, a caller's own
server) types against this protocol and serves any of them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from typing import Any, Protocol, runtime_checkable

from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.sampling_params import SamplingParams


@runtime_checkable
class Front(Protocol):
    """Admit, stream, abort."""

    async def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Admit one request and return its id; raises for bad input or a full queue."""
        ...

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until its final one; stopping early aborts it."""
        ...

    def abort(self, request_ids: str | Iterable[str], reason: str = ...) -> None:
        """Abort requests; ids unknown or finished when the abort applies are ignored."""
        ...
