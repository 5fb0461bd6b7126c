"""A worker extension the harness adds to every engine it builds: it reports
the per-request state a pipeline says it holds."""

from __future__ import annotations

from typing import Any

#: Import path of :class:`HeldStateProbe`, for ``EngineConfig.worker_extensions``.
PROBE_PATH = "diffusion_runtime.testing.probes:HeldStateProbe"


class HeldStateProbe:
    """``pipeline_held_request_ids()``: the ids from the pipeline's optional
    ``held_request_ids()`` (empty for a pipeline without one)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def pipeline_held_request_ids(self) -> list[str]:
        held = getattr(self.worker.pipeline, "held_request_ids", None)
        return sorted(held()) if callable(held) else []
