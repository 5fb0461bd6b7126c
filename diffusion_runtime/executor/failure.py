"""How the multi-worker executors fail: the shutdown reason, and reports from monitors."""

from __future__ import annotations

from collections.abc import Callable

from diffusion_runtime.executor.base import DiffusionExecutor

#: What a call raises (in an :class:`~diffusion_runtime.errors.EngineDeadError`)
#: once its executor was shut down.
SHUT_DOWN = "the executor was shut down"


def report_failure(executor_ref: Callable[[], DiffusionExecutor | None], reason: str) -> None:
    """Mark the executor failed for ``reason``, unless it was collected meanwhile.

    A monitor thread holds its executor through a weak reference, ``executor_ref``,
    so that a forgotten executor is still collected (and its finalizer run).
    """
    executor = executor_ref()
    if executor is not None:
        executor.mark_failed(reason)
