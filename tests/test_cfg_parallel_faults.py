"""Ranks that share one model and die or hang: every caller learns within the
liveness bound, and nothing is left.

A rank killed or stopped inside a guided step (CFG-parallel digits; a DiT whose
tokens two Ulysses ranks split) leaves its peer waiting in a collective; the
executor's death monitor fails every call with :class:`EngineDeadError`, the
peer's collective is bounded by the group's timeout (the liveness bound),
and ``close()`` stops both ranks, destroys the group and removes its
rendezvous directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import wait_for
from executor_helpers import run_in_thread

from diffusion_runtime import DiffusionEngine, EngineConfig, EngineDeadError, SamplingParams
from diffusion_runtime.executor.mp import executor as mp_executor
from diffusion_runtime.executor.mp.executor import RENDEZVOUS_PREFIX
from diffusion_runtime.executor.mp.segments import SEGMENT_PREFIX, segment_names
from diffusion_runtime.testing.leaks import Leftovers, rendezvous_dirs
from diffusion_runtime.testing.patching import replace_attribute

LIVENESS_S = 2.0
GRACE_S = 1.0
LONG_GUIDED = SamplingParams(num_inference_steps=1000, guidance_scale=3.0)


#: Where rank 1 marks that it is running guided steps (set by the test, inherited by workers).
FLAG_ENV = "DIFFUSION_RT_TEST_RUNNING_FLAG"


class Probe:
    """A worker extension: this rank's pid; on rank 1, a file touched once its
    network has run a few passes, so the test kills it in the middle of a run."""

    def __init__(self, worker: Any) -> None:
        self.passes = 0
        self.flag = Path(os.environ[FLAG_ENV]) if worker.rank == 1 else None
        pipeline = worker.pipeline
        if hasattr(pipeline, "model"):
            model = pipeline.model
        else:  # a split DiT runs its blocks, not the transformer's forward
            model = pipeline.family.pipe.transformer.transformer_blocks[0]
        model.register_forward_pre_hook(self._count)

    def _count(self, module: Any, args: Any) -> None:
        self.passes += 1
        if self.flag is not None and self.passes == 5:
            self.flag.touch()

    def pid(self) -> int:
        return os.getpid()


#: How each fault shows: killed at once, or stopped (hung) until the liveness bound.
FAULTS = {
    signal.SIGKILL: r"killed by SIGKILL|between ranks",
    signal.SIGSTOP: r"no heartbeat|between ranks",
}
DIGITS_CFG = {"pipeline": "digits", "cfg_parallel_size": 2}


@pytest.mark.parametrize(
    ("mode", "fault", "split"),
    [
        pytest.param("request", signal.SIGKILL, "cfg", id="request-killed"),
        pytest.param("step", signal.SIGKILL, "cfg", id="step-killed"),
        pytest.param("step", signal.SIGSTOP, "cfg", id="step-stopped"),
        pytest.param("step", signal.SIGSTOP, "ulysses", id="dit-ulysses-step-stopped"),
    ],
)
def test_a_rank_killed_or_hung_mid_collective_fails_every_caller_and_close_leaves_nothing(
    mode: str,
    fault: signal.Signals,
    split: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    flag = tmp_path / "running"
    monkeypatch.setenv(FLAG_ENV, str(flag))
    if split == "cfg":
        degrees: dict[str, Any] = DIGITS_CFG
        prompt: Any = "3"
    else:  # the DiT's all-to-alls over heads, every step
        request.getfixturevalue("models").dit_pipeline().save_pretrained(tmp_path / "dit")
        path = str(tmp_path / "dit")
        degrees = {"pipeline": "diffusers", "pipeline_kwargs": {"path": path}, "ulysses_degree": 2}
        prompt = 3
    baseline = Leftovers.baseline()
    config = EngineConfig(
        **degrees,
        device="cpu",
        execution_mode=mode,
        warmup=False,
        worker_extensions=(Probe,),
        worker_liveness_timeout_s=LIVENESS_S,
        shutdown_grace_s=GRACE_S,
        worker_start_timeout_s=120.0,
    )
    engine = DiffusionEngine.make_engine(config)
    try:
        _, victim = engine.collective_rpc("pid")
        callers = [
            run_in_thread(lambda p=params: engine.generate([prompt], p))
            for params in (attrs.evolve(LONG_GUIDED, seed=s) for s in (1, 2))
        ]
        assert wait_for(flag.exists, timeout=60)
        os.kill(victim, fault)
        struck = time.monotonic()
        for caller in callers:
            # The death monitor or rank 0's broken gather, whichever is first.
            with pytest.raises(EngineDeadError, match=FAULTS[fault]):
                caller.result(LIVENESS_S + 5)
        assert time.monotonic() - struck < LIVENESS_S + 1.0
    finally:
        closing = time.monotonic()
        engine.close()
        assert time.monotonic() - closing < GRACE_S + 5
    assert baseline.since() == []
    assert segment_names(f"{SEGMENT_PREFIX}{os.getpid()}-") == []


def test_the_leak_check_names_a_rendezvous_directory_left_at_close() -> None:
    """A mutation as a plain test (the core harness checks no leftovers): an executor
    that forgets its rendezvous directory at close is caught by :class:`Leftovers`."""

    def keeps_rendezvous(original: Any) -> Any:
        def remove_leftovers(segment_prefix: str, dist_dir: str | None) -> None:
            original(segment_prefix, None)  # "the group's files go with the group"

        return remove_leftovers

    baseline = Leftovers.baseline()
    config = EngineConfig(
        pipeline="digits", device="cpu", cfg_parallel_size=2, warmup=False,
        worker_start_timeout_s=120.0,
    )  # fmt: skip
    with replace_attribute(mp_executor, "_remove_leftovers", keeps_rendezvous):
        DiffusionEngine.make_engine(config).close()
    left = baseline.since(settle_s=1.0)
    for name in rendezvous_dirs() - baseline.rendezvous_dirs:
        shutil.rmtree(Path(tempfile.gettempdir(), name))
    [kept] = left
    assert kept.startswith(f"rendezvous directory {RENDEZVOUS_PREFIX}{os.getpid()}-")
    assert baseline.since() == []
