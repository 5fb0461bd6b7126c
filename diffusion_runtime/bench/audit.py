"""Online auditing on a real workload: digits throughput with and without the auditor.

The same ``generate`` of B digit requests runs on three engines built alike
except for ``EngineConfig.audit``/``trace_path``: ``off``, ``report`` (the online
auditor, INV-001..009) and a JSON-lines trace. Rounds interleave the engines in
one process; the best round of each is kept, and ratios compare them.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.sampling_params import SamplingParams


def run(
    batch_sizes: tuple[int, ...] = (1, 8), steps: int = 25, repeats: int = 7, mode: str = "step"
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps, seed=0)
    results: dict[str, Any] = {"benchmark": "audit", "steps": steps, "mode": mode, "batches": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for size in batch_sizes:
            base = EngineConfig(
                pipeline="digits", device="cpu", max_num_seqs=size, execution_mode=mode
            )
            variants = {
                "off": base,
                "audited": attrs.evolve(base, audit="report"),
                "traced": attrs.evolve(base, trace_path=str(Path(scratch, f"t{size}.jsonl"))),
            }
            engines = {name: DiffusionEngine.make_engine(c) for name, c in variants.items()}
            prompts = [str(i % 10) for i in range(size)]
            best = dict.fromkeys(engines, float("inf"))
            try:
                for _ in range(repeats):
                    for name, engine in engines.items():
                        start = time.perf_counter()
                        engine.generate(prompts, params)
                        best[name] = min(best[name], time.perf_counter() - start)
            finally:
                for engine in engines.values():
                    engine.close()
            results["batches"][str(size)] = {
                "best_s": best,
                "audited_throughput_vs_off": best["off"] / best["audited"],
                "traced_throughput_vs_off": best["off"] / best["traced"],
            }
    return results
