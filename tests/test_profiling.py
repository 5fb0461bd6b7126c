"""start_profile/stop_profile: one torch.profiler trace per worker, only into profile_dir."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cli import run_cli

from diffusion_runtime import DiffusionEngine, EngineConfig, ProfilingError, SamplingParams

FAST = SamplingParams(num_inference_steps=2, seed=1)


def trace_ops(path: Path) -> set[str]:
    """The names of the events of a Chrome trace (checked to be one)."""
    trace = json.loads(path.read_text())
    return {event["name"] for event in trace["traceEvents"] if "name" in event}


def test_a_profile_of_the_calling_and_the_loop_thread_writes_one_trace(
    make_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    engine = make_engine("digits", profile_dir=str(tmp_path))
    [path] = engine.start_profile("calls")
    assert engine.stop_profile() == [path] and path == str(tmp_path / "calls-rank0.json")

    async def stream_one() -> None:
        request_id = await engine.add_request("4", FAST)
        async for _ in engine.stream(request_id):
            pass

    engine.start_profile("loop")  # started on this thread; the loop thread runs the wave
    asyncio.run(stream_one())
    [looped] = engine.stop_profile()
    assert "aten::linear" in trace_ops(Path(looped))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls-rank0.json", "loop-rank0.json"]


def test_every_worker_process_writes_its_own_trace(tmp_path: Path) -> None:
    config = EngineConfig(
        pipeline="digits",
        device="cpu",
        executor_backend="mp",
        num_workers=2,
        warmup=False,
        profile_dir=str(tmp_path / "made" / "here"),
    )
    with DiffusionEngine.make_engine(config) as engine:
        engine.start_profile("mp")
        engine.generate(["1", "2"], FAST)
        paths = engine.stop_profile()
    assert [Path(p).name for p in paths] == ["mp-rank0.json", "mp-rank1.json"]
    for path in paths:
        assert "aten::linear" in trace_ops(Path(path))


def test_profiling_is_refused_without_a_profile_dir(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("testing-noise")
    with pytest.raises(ProfilingError, match="profile_dir"):
        engine.start_profile()
    with pytest.raises(ProfilingError, match="profile_dir"):
        engine.stop_profile()
    # Nor through the worker's own RPC method.
    with pytest.raises(ProfilingError, match="profile_dir"):
        engine.collective_rpc("start_profile", ("x",))


def test_bad_prefixes_and_orders_are_refused(
    make_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    engine = make_engine("testing-noise", profile_dir=str(tmp_path))
    for prefix in ("../escape", "a/b", ".hidden", "", "x" * 101):
        with pytest.raises(ProfilingError, match="prefix"):
            engine.start_profile(prefix)
    with pytest.raises(ProfilingError, match="not profiling"):
        engine.stop_profile()
    [path] = engine.start_profile()
    assert Path(path).name.startswith("profile-")
    with pytest.raises(ProfilingError, match="already profiling"):
        engine.start_profile()
    engine.stop_profile()
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]


def test_cli_generate_profile_writes_a_trace(tmp_path: Path) -> None:
    run = run_cli(
        "generate", "1", "--steps", "2", "--device", "cpu", "--profile", "traces",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    trace = tmp_path / "traces" / "generate-rank0.json"
    assert f"profile: {trace.relative_to(tmp_path)}" in run.stderr
    assert "aten::linear" in trace_ops(trace)
