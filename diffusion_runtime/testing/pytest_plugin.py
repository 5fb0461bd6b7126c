"""The pytest plugin (entry point ``pytest11``), loaded by pytest once the package is installed.

- ``--audit``: every engine core a test creates gets an online auditor; a
  violation fails the test, with the events that prove it.
- ``engine_factory``: builds engines and closes them after the test.
- ``lifecycle_harness``: runs the deterministic core harness over a config
  factory; a failure reports the shrunk rules (hypothesis prints them), the
  violation with its events, a trace file of the failing example that
  ``diffusion-runtime audit`` re-checks (``--perfetto`` draws it), and a
  replay file that ``diffusion-runtime audit --replay`` reruns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from diffusion_runtime.config import EngineConfig
    from diffusion_runtime.engine import DiffusionEngine

# Heavy imports (torch, hypothesis) wait until a fixture is used: pytest loads
# this plugin in every session of an environment that has the package.

EngineFactory = Callable[..., "DiffusionEngine"]
LifecycleHarness = Callable[..., None]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--audit",
        action="store_true",
        default=False,
        help="attach the diffusion-runtime invariant auditor to every engine; fail on a violation",
    )


@pytest.fixture(autouse=True)
def _audit_every_engine(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.config.getoption("--audit"):
        yield
        return
    from diffusion_runtime.core import EngineCore
    from diffusion_runtime.fsm.audit import Auditor

    auditors: list[Auditor] = []
    original = EngineCore._start_trace

    def start_trace_with_auditor(core: EngineCore) -> None:
        auditor = Auditor()
        auditors.append(auditor)
        core.machine.subscribe(auditor.feed)
        original(core)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineCore, "_start_trace", start_trace_with_auditor)
        yield
    found = [v for auditor in auditors for v in auditor.finish()]
    if found:
        report = "\n".join(v.describe() for v in found[:5])
        pytest.fail(f"{len(found)} invariant violation(s); the first:\n{report}", pytrace=False)


@pytest.fixture
def engine_factory() -> Iterator[EngineFactory]:
    """``engine_factory(config, **kwargs)`` builds an engine that is closed after the test."""
    from diffusion_runtime.engine import DiffusionEngine

    engines: list[DiffusionEngine] = []

    def build(config: EngineConfig, **kwargs: Any) -> DiffusionEngine:
        engine = DiffusionEngine.make_engine(config, **kwargs)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


@pytest.fixture
def lifecycle_harness(tmp_path: Path, request: pytest.FixtureRequest) -> LifecycleHarness:
    """``lifecycle_harness(config_factory, max_examples=50, steps=20, **options)`` runs the
    core harness (options as for ``core_lifecycle_machine``) and fails the test on a bug,
    naming the failing example's trace file and replay file."""

    def run(
        config: Callable[[], EngineConfig],
        *,
        max_examples: int = 50,
        steps: int = 20,
        **options: Any,
    ) -> None:
        from hypothesis.stateful import run_state_machine_as_test

        from diffusion_runtime.testing.core_harness import core_lifecycle_machine
        from diffusion_runtime.testing.profiles import harness_settings
        from diffusion_runtime.testing.replay import (
            ChoiceRecorder,
            recipe_for_harness,
            record_failure,
        )

        trace = tmp_path / "failing-example.jsonl"
        machine = core_lifecycle_machine(config, trace_path=trace, **options)
        settings, recorder = ChoiceRecorder.around(
            harness_settings(max_examples=max_examples, stateful_step_count=steps)
        )
        try:
            run_state_machine_as_test(machine, settings=settings)
        except Exception as exc:
            replay = record_failure(
                exc,
                tmp_path,
                lambda: recipe_for_harness(config, options, request.module),
                settings,
                recorder,
            )
            raise AssertionError(
                f"{exc}\n\nThe failing example's trace: {trace}\n"
                f"re-check it with: diffusion-runtime audit {trace} --perfetto trace.json\n"
                f"{replay}"
            ) from exc

    return run
