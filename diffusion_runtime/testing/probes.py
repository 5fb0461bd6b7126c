"""A worker extension the harness adds to every engine it builds: it reports
the per-request state a pipeline says it holds."""

from __future__ import annotations

from typing import Any

#: Import path of :class:`HeldStateProbe`, for ``EngineConfig.worker_extensions``.
PROBE_PATH = "diffusion_runtime.testing.probes:HeldStateProbe"


class HeldStateProbe:
    """``pipeline_held_request_ids()``: the ids from the pipeline's optional
    ``held_request_ids()`` (empty for a pipeline without one).
    ``rpc_sequence()``: how many times it was called, so a caller can tell a
    stale reply from a fresh one. ``offload_restores()``: how many preempted
    states the runner has brought back from host memory (0 without a budget)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._calls = 0

    def rpc_sequence(self) -> int:
        self._calls += 1
        return self._calls

    def pipeline_held_request_ids(self) -> list[str]:
        held = getattr(self.worker.pipeline, "held_request_ids", None)
        return sorted(held()) if callable(held) else []

    def offload_restores(self) -> int:
        offloader = self.worker.runner.offloader
        return 0 if offloader is None else int(offloader.restores)
