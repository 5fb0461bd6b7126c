from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from diffusion_runtime import DiffusionEngine, EngineConfig
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline

settings.register_profile(
    "ci",
    max_examples=50,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ENGINE_THREAD = "diffusion-engine-loop"


def child_pids() -> set[int]:
    """Live child processes of this one (from /proc), except multiprocessing's resource tracker."""
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == me and b"resource_tracker" not in cmdline:
            found.add(int(entry))
    return found


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == ENGINE_THREAD]


@pytest.fixture
def make_engine() -> Iterator[Callable[..., DiffusionEngine]]:
    """Build engines that are closed at teardown; fail if any loop thread outlives them."""
    engines: list[DiffusionEngine] = []

    def build(pipeline: Any = "testing-noise", **overrides: Any) -> DiffusionEngine:
        overrides.setdefault("device", "cpu")
        engine = DiffusionEngine.make_engine(EngineConfig(pipeline=pipeline, **overrides))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()
    assert engine_threads() == []


@pytest.fixture
def faults() -> FaultInjectingPipeline:
    """A fault-injecting pipeline the test holds, to open gates and read its batches."""
    return FaultInjectingPipeline("cpu")


def factory_of(pipeline: object) -> Callable[..., object]:
    """An EngineConfig pipeline factory that hands out an existing pipeline object."""

    def factory(device: object) -> object:
        return pipeline

    return factory
