"""Test tools for the runtime and for users' own components.

- :mod:`~diffusion_runtime.testing.harness`: the lifecycle property test
  (:func:`lifecycle_test_case`, :func:`lifecycle_machine`), over the fronts of
  :mod:`~diffusion_runtime.testing.fronts` (an engine) and
  :mod:`~diffusion_runtime.testing.stage_front` (a stage, held between steps
  by :mod:`~diffusion_runtime.testing.stage_hold`);
- :mod:`~diffusion_runtime.testing.leaks`: what a test left behind (processes,
  threads, stage socket directories);
- :mod:`~diffusion_runtime.testing.strategies`: hypothesis strategies;
- :mod:`~diffusion_runtime.testing.mutations`: broken runtimes the harness must catch
  (the stage's in :mod:`~diffusion_runtime.testing.stage_mutations`);
- :mod:`~diffusion_runtime.testing.pipelines`: small deterministic pipelines
  with fault injection (no hypothesis needed);
- :mod:`~diffusion_runtime.testing.replay`: failing examples as replay files
  (format: :mod:`~diffusion_runtime.testing.replay_file`), and their reruns.

The harness needs ``hypothesis`` (the ``test`` extra); it is imported on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EngineLifecycleMachine", "lifecycle_machine", "lifecycle_test_case"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from diffusion_runtime.testing import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
