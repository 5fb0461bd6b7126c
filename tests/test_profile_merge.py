"""`audit TRACE --perfetto OUT --profile DIR`: the lifecycle trace and the workers'
torch.profiler traces in one Chrome trace-event file, on one clock.

The merged file is checked against the trace-event format's rules (what
Perfetto's JSON importer reads) and a wave's profiler slices must nest inside
the lifecycle's span of that wave.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from test_cli import run_cli

from diffusion_runtime import DiffusionEngine, EngineConfig, SamplingParams
from diffusion_runtime.fsm.perfetto import WAVES_PID
from diffusion_runtime.fsm.profile_merge import CLOCK_MARK, PROFILE_PID_BASE

PARAMS = SamplingParams(num_inference_steps=3, seed=5)
#: Metadata records the format defines.
METADATA = {
    "process_name",
    "process_labels",
    "process_sort_index",
    "thread_name",
    "thread_sort_index",
}
#: How far the profiler's own clock conversion (its TSC to wall time) may stray, in µs.
CLOCK_TOLERANCE_US = 100.0


def check_trace_event_format(document: Any) -> None:
    """The rules of the trace-event format that Perfetto's JSON importer relies on."""
    json.dumps(document, allow_nan=False)  # plain JSON: no NaN or infinity
    assert isinstance(document, dict) and isinstance(document["traceEvents"], list)
    open_slices: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    complete: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in document["traceEvents"]:
        phase = event["ph"]
        assert isinstance(event.get("name", ""), str), event
        assert type(event["pid"]) is int, event
        if phase == "M":
            assert event["name"] in METADATA and isinstance(event["args"], dict), event
            if "tid" in event:
                assert type(event["tid"]) is int, event
            continue
        assert type(event["tid"]) is int, event
        ts = event["ts"]
        assert isinstance(ts, (int, float)) and math.isfinite(ts) and ts >= 0, event
        track = (event["pid"], event["tid"])
        if phase == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
            complete[track].append(event)
        elif phase == "B":
            open_slices[track].append(event)
        elif phase == "E":
            assert open_slices[track], f"an E without its B: {event}"
            assert open_slices[track].pop()["ts"] <= ts, event
        elif phase in ("i", "I"):
            assert event.get("s", "t") in ("g", "p", "t"), event
        elif phase in ("s", "t", "f"):
            assert "id" in event, event
        else:
            assert phase in ("C", "n", "b", "e", "P", "O", "N", "D"), event
    assert not any(open_slices.values()), "B slices never ended"
    for slices in complete.values():  # slices of one track nest or follow each other
        stack: list[float] = []
        for s in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= s["ts"]:
                stack.pop()
            end = s["ts"] + s["dur"]
            assert not stack or end <= stack[-1] + 1e-3, f"a slice overlaps its parent: {s}"
            stack.append(end)


def profiled_run(tmp_path: Path, **config: Any) -> tuple[Path, Path]:
    """A traced run with a profile around it; the trace file and the profile folder."""
    trace, profiles = tmp_path / "run.jsonl", tmp_path / "profiles"
    engine_config = EngineConfig(
        pipeline="digits",
        device="cpu",
        execution_mode="step",
        warmup=False,
        trace_path=str(trace),
        profile_dir=str(profiles),
        **config,
    )
    with DiffusionEngine.make_engine(engine_config) as engine:
        engine.generate(["1"], PARAMS)  # before the profile: waves with no slices
        engine.start_profile("run")
        engine.generate(["3", "7"], [PARAMS, SamplingParams(num_inference_steps=2, seed=6)])
        engine.stop_profile()
    return trace, profiles


@pytest.mark.parametrize(
    "workers", [{}, {"executor_backend": "mp", "num_workers": 2}], ids=["uni", "mp"]
)
def test_the_merged_trace_is_valid_and_each_waves_slices_nest_in_its_wave(
    tmp_path: Path, workers: dict[str, Any]
) -> None:
    trace, profiles = profiled_run(tmp_path, **workers)
    out = tmp_path / "merged.json"
    run = run_cli(
        "audit", str(trace), "--perfetto", str(out), "--profile", str(profiles), cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    document = json.loads(out.read_text())
    check_trace_event_format(document)

    events = document["traceEvents"]
    waves = {e["name"]: e for e in events if e["pid"] == WAVES_PID and e["ph"] == "X"}
    profiled = [e for e in events if e["pid"] >= PROFILE_PID_BASE and e["ph"] == "X"]
    ranks = {e["pid"] // PROFILE_PID_BASE for e in profiled if e["name"].startswith(CLOCK_MARK)}
    assert len(ranks) == workers.get("num_workers", 1)  # one profile per worker, each aligned
    nested = 0
    for wave_slice in (e for e in profiled if e["name"].startswith("wave ")):
        wave = waves[wave_slice["name"]]  # the lifecycle's span of the same wave
        assert wave["ts"] - CLOCK_TOLERANCE_US <= wave_slice["ts"], (wave, wave_slice)
        end = wave_slice["ts"] + wave_slice["dur"]
        if wave_slice["pid"] // PROFILE_PID_BASE == 1:
            # Rank 0 replies for the wave; other ranks may still be finishing theirs.
            assert end <= wave["ts"] + wave["dur"] + CLOCK_TOLERANCE_US, (wave, wave_slice)
        kernels = [
            e
            for e in profiled
            if e["name"] == "aten::linear"
            and (e["pid"], e["tid"]) == (wave_slice["pid"], wave_slice["tid"])
            and wave_slice["ts"] <= e["ts"] <= end
        ]
        assert kernels, f"no aten::linear inside {wave_slice['name']}"
        nested += 1
    # Five steps for the profiled requests (3 and 2, batched); the first run is unprofiled.
    assert nested >= 3 * workers.get("num_workers", 1)
    profiled_waves = {e["name"] for e in profiled if e["name"].startswith("wave ")}
    assert "wave 0" not in profiled_waves and len(profiled_waves) < len(waves)


def bad_profile_dirs(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x-rank0.json").write_text(json.dumps({"traceEvents": [], "baseTimeNanoseconds": 0}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x-rank0.json").write_text("{not json")
    return {
        "is not a directory": tmp_path / "missing",
        "no worker profiles": empty,
        "has no clock mark": foreign,
        "cannot read the profile": broken,
    }


def test_a_bad_profile_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    trace.write_text('{"kind": "engine", "state": "started", "time": 1.0, "reason": null}\n')
    out = tmp_path / "out.json"
    for why, folder in bad_profile_dirs(tmp_path).items():
        run = run_cli(
            "audit", str(trace), "--perfetto", str(out), "--profile", str(folder), cwd=tmp_path
        )
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
        assert why in run.stderr and "Traceback" not in run.stderr
    run = run_cli("audit", str(trace), "--profile", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2 and "goes with --perfetto" in run.stderr
    assert not out.exists()
