"""Online auditing on a real workload: digits throughput with and without the auditor.

The same ``generate`` of B digit requests runs on engines built alike except
for ``EngineConfig.audit``/``trace_path``: ``off``, a second ``off`` (its
twin: how far two identical engines differ, the noise floor of the ratios),
``audited`` (the online auditor, INV-001..010) and ``traced`` (a JSON-lines
trace). Rounds interleave the engines in one process and keep each one's best
round. Time is the driving thread's CPU time (``time.thread_time``: with one
torch thread the whole step runs on it), so other work on a shared machine
moves the figures less than wall time would; wall-time ratios are reported too.

Separately, ``checkers_us_per_step`` times a fresh auditor fed the recorded
events of one audited ``generate``: the checkers' own cost, free of noise,
as microseconds per step and as a share of the engine's step.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from diffusion_runtime.bench.stats import Stopwatch
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.fsm.audit import Auditor
from diffusion_runtime.fsm.events import EngineEvent, TraceEvent, WaveEvent
from diffusion_runtime.sampling_params import SamplingParams

VARIANTS = ("off", "off_twin", "audited", "traced")


def run(
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    steps: int = 25,
    repeats: int = 11,
    mode: str = "step",
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps, seed=0)
    results: dict[str, Any] = {"benchmark": "audit", "steps": steps, "mode": mode, "batches": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for size in batch_sizes:
            base = EngineConfig(
                pipeline="digits",
                device="cpu",
                max_num_seqs=size,
                execution_mode=mode,
                intra_op_threads=1,
            )
            configs = {
                "off": base,
                "off_twin": base,
                "audited": attrs.evolve(base, audit="report"),
                "traced": attrs.evolve(base, trace_path=str(Path(scratch, f"t{size}.jsonl"))),
            }
            prompts = [str(i % 10) for i in range(size)]
            engines = {name: DiffusionEngine.make_engine(c) for name, c in configs.items()}
            try:
                cpu, wall = _best_rounds(engines, prompts, params, repeats)
                events = _recorded_events(engines["audited"], prompts, params)
            finally:
                for engine in engines.values():
                    engine.close()
            waves = sum(isinstance(e, WaveEvent) for e in events)
            checkers_s = _checkers_seconds(events)
            step_s = cpu["off"] / max(waves, 1)
            results["batches"][str(size)] = {
                "best_cpu_s": cpu,
                "best_wall_s": wall,
                **{f"{name}_throughput_vs_off": cpu["off"] / cpu[name] for name in VARIANTS[1:]},
                **{
                    f"{name}_wall_throughput_vs_off": wall["off"] / wall[name]
                    for name in VARIANTS[1:]
                },
                "checkers_us_per_step": round(checkers_s / max(waves, 1) * 1e6, 1),
                "checkers_share_of_step": round(checkers_s / max(waves, 1) / step_s, 4),
            }
    return results


def _best_rounds(
    engines: dict[str, DiffusionEngine],
    prompts: list[str],
    params: SamplingParams,
    repeats: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Each engine's best CPU and wall time for one ``generate``, rounds interleaved."""
    cpu = dict.fromkeys(engines, float("inf"))
    wall = dict.fromkeys(engines, float("inf"))
    for _ in range(repeats):
        for name, engine in engines.items():
            cpu_watch, wall_watch = Stopwatch(time.thread_time), Stopwatch()
            engine.generate(prompts, params)
            cpu[name] = min(cpu[name], cpu_watch.seconds())
            wall[name] = min(wall[name], wall_watch.seconds())
    return cpu, wall


def _recorded_events(
    engine: DiffusionEngine, prompts: list[str], params: SamplingParams
) -> list[TraceEvent]:
    events: list[TraceEvent] = []
    engine.machine.subscribe(events.append)
    engine.generate(prompts, params)
    return events


def _checkers_seconds(events: list[TraceEvent], repeats: int = 20) -> float:
    """The best time a fresh auditor (one that saw the engine start) takes over ``events``."""
    best = float("inf")
    for _ in range(repeats):
        auditor = Auditor()
        auditor.feed(EngineEvent("started", 0.0))
        watch = Stopwatch()
        for event in events:
            auditor.feed(event)
        best = min(best, watch.seconds())
    return best
