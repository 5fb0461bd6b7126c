from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import settings

from diffusion_runtime import DiffusionEngine, EngineConfig
from diffusion_runtime.bench.device_memory import device_memory_in_use
from diffusion_runtime.core import EngineCore
from diffusion_runtime.scheduler import BaseScheduler
from diffusion_runtime.testing.leaks import child_pids  # noqa: F401  (tests import it from here)
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline
from diffusion_runtime.testing.profiles import register_profiles

register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ENGINE_THREAD = "diffusion-engine-loop"

# -- the device the suite runs on (--device) --------------------------------------------

#: Device memory a test may leave in use beyond its baseline: driver bookkeeping
#: (cuBLAS workspaces, cached kernels of a first use), never a request's tensors.
DEVICE_MEMORY_SLACK_BYTES = 64 * 2**20

_device = "cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="run the device tests (stateful harness, identity and cleanup properties, "
        "digits and diffusers equality, mp executor) on this device; default cpu",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _device
    _device = config.getoption("--device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _device == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(
            reason="--device cuda: torch sees no CUDA device here "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
        for item in items:
            item.add_marker(skip)


def suite_device() -> str:
    """The device given with ``--device``: ``"cpu"`` or ``"cuda"`` (rank r uses ``cuda:r``)."""
    return _device


def suite_device_index() -> str:
    """The device with an index (``"cuda:0"``): every worker of an engine shares it."""
    return "cuda:0" if _device == "cuda" else "cpu"


@pytest.fixture(autouse=True)
def device_memory_returns_to_baseline() -> Iterator[None]:
    """With ``--device cuda``: after each test, the memory this process holds on the
    device is back at its baseline, and so is the device's (worker processes' too)."""
    if _device != "cuda":
        yield
        return
    before = device_memory_in_use()
    yield
    assert_device_memory_at(before)


def assert_device_memory_at(baseline: tuple[int, int]) -> None:
    """No tensor outlived what made it; worker processes released their memory."""
    allocated, in_use = device_memory_in_use()
    assert allocated <= baseline[0], (
        f"{allocated - baseline[0]} bytes of tensors left on the device"
    )
    assert in_use <= baseline[1] + DEVICE_MEMORY_SLACK_BYTES, (
        f"{in_use - baseline[1]} more bytes in use on the device than before"
    )


# -- no test reads the real clock to decide a result ---------------------------------

#: Seeds the offsets ``monotonic_offset`` draws; run again with another seed to
#: try other offsets. ``DR_CLOCK_OFFSET`` pins one offset (to retry a failing one).
CLOCK_OFFSET_SEED = os.environ.get("DR_CLOCK_OFFSET_SEED", "0")
PINNED_CLOCK_OFFSET = os.environ.get("DR_CLOCK_OFFSET")


@pytest.fixture
def monotonic_offset(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """Move the real clock ahead by a large random offset, drawn per test in [1e3, 1e7]
    seconds (log-uniform) from ``DR_CLOCK_OFFSET_SEED`` and the test's id, and return it.

    A result that follows from a real clock reading (a reading plus a decimal
    lands on either side of another sum) then changes with the offset, so the
    test fails for some seeds; the offset is printed, so a failure shows it.
    Patched: ``time.monotonic`` (read through the module at each call), and the
    default clocks of the scheduler and the core, which bound it at import.
    ``threading`` and ``queue`` bound theirs too: lock and queue timeouts keep
    the real clock.
    """
    if PINNED_CLOCK_OFFSET is not None:
        offset = float(PINNED_CLOCK_OFFSET)
    else:
        # Log-uniform: whether a sum rounds up or down depends on the binary
        # exponent of the reading, so every exponent in the range gets its turn.
        draw = random.Random(f"{CLOCK_OFFSET_SEED}:{request.node.nodeid}")
        offset = 10.0 ** draw.uniform(3.0, 7.0)
    real = time.monotonic

    def shifted() -> float:
        return real() + offset

    monkeypatch.setattr(time, "monotonic", shifted)
    monkeypatch.setattr(BaseScheduler, "clock", staticmethod(shifted))
    core_defaults = EngineCore.__init__.__kwdefaults__ or {}
    if core_defaults.get("clock") is real:
        monkeypatch.setitem(core_defaults, "clock", shifted)
    print(f"monotonic_offset: DR_CLOCK_OFFSET={offset!r} DR_CLOCK_OFFSET_SEED={CLOCK_OFFSET_SEED}")
    return offset


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


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


@pytest.fixture(scope="module")
def models() -> Any:
    """The tiny diffusers models built from config (skips without diffusers)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import diffusers_models

    return diffusers_models
