"""Test tools for the runtime and for users' own components.

- :mod:`~diffusion_runtime.testing.core_harness`: the deterministic lifecycle
  harness over an :class:`~diffusion_runtime.core.EngineCore`, one ``step()`` at
  a time (its rules make any scheduler that can preempt do so);
  :mod:`~diffusion_runtime.testing.deadline_harness` (on a virtual clock) adds
  rules and checks to it;
- :mod:`~diffusion_runtime.testing.harness`: the front harness
  (:func:`lifecycle_test_case`, :func:`lifecycle_machine`) over the fronts of
  :mod:`~diffusion_runtime.testing.fronts` (an engine and its loop thread),
  :mod:`~diffusion_runtime.testing.lockstep` (an engine the harness drives
  itself, racing its loop, with exact pause checks) and
  :mod:`~diffusion_runtime.testing.stage_front` (a stage, held between steps
  by :mod:`~diffusion_runtime.testing.stage_hold`);
- :mod:`~diffusion_runtime.testing.oracle` and :mod:`~diffusion_runtime.testing.reach`:
  the direct-call oracle and the count of paths a run reached;
- :mod:`~diffusion_runtime.testing.leaks`: what a test left behind (processes,
  threads, stage socket directories);
- :mod:`~diffusion_runtime.testing.strategies`: hypothesis strategies;
- :mod:`~diffusion_runtime.testing.mutations`: broken runtimes the harnesses must
  catch, each a :class:`~diffusion_runtime.testing.mutation.Mutation` (with
  :mod:`.policy_mutations`, :mod:`.preemption_mutations`, :mod:`.deadline_mutations`,
  :mod:`.stage_mutations` and :mod:`.gap_mutations`), hunted on the harness target
  it names (:mod:`~diffusion_runtime.testing.targets` resolves them);
- :mod:`~diffusion_runtime.testing.profiles`: the hypothesis settings of every run;
- :mod:`~diffusion_runtime.testing.pipelines`: small deterministic pipelines
  with fault injection (no hypothesis needed);
- :mod:`~diffusion_runtime.testing.replay`: failing examples as replay files
  (format: :mod:`~diffusion_runtime.testing.replay_file`), and their reruns;
- :mod:`~diffusion_runtime.testing.pytest_plugin`: ``pytest --audit`` and the
  ``engine_factory`` and ``lifecycle_harness`` fixtures.

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
