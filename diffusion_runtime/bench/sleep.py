"""Sleep and wake: how long each takes at both levels, what memory it frees, and
what the first request after a wake costs against a warm one.

One in-process engine (digits, uni executor, request mode) per level. Each
round: a warm ``generate`` (timed), ``sleep(level)`` (timed), the memory read
while asleep, ``wake_up()`` (timed), and the first ``generate`` after the wake
(timed). Figures are medians over the rounds (wall time, milliseconds).
Memory: the bytes of weight storage the workers hold on the device
(``device_weight_bytes``, exact) and, on the CPU, the process's resident set
(``/proc/self/statm``; the allocator decides when freed pages go back, so
treat it as a rough figure). On CUDA: the bytes this process's tensors hold
on the device before the engine, loaded and asleep, and whether asleep is
within 5% of the weights above the pre-load baseline (``docs/operations.md``).
"""

from __future__ import annotations

import gc
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffusion_runtime.bench.device_memory import device_memory_in_use
from diffusion_runtime.bench.stats import Stopwatch
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.sampling_params import SamplingParams

#: The share of the loaded weights a level-2 sleep may leave on the device.
DEVICE_MEMORY_TOLERANCE = 0.05


def run(
    rounds: int = 5,
    steps: int = 10,
    batch: int = 4,
    device: str = "cpu",
    pipeline: str = "digits",
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps, seed=0)
    prompts = [str(i % 10) for i in range(batch)]
    result: dict[str, Any] = {
        "benchmark": "sleep",
        "device": device,
        "pipeline": pipeline,
        "steps": steps,
        "batch": batch,
        "rounds": rounds,
    }
    for level in (1, 2):
        result[f"level_{level}"] = _level(level, rounds, pipeline, device, prompts, params)
    return result


def _level(
    level: int,
    rounds: int,
    pipeline: str,
    device: str,
    prompts: list[str],
    params: SamplingParams,
) -> dict[str, Any]:
    on_cuda = device.startswith("cuda")
    before = _device_bytes() if on_cuda else 0
    config = EngineConfig(pipeline=pipeline, device=device, intra_op_threads=1)
    samples: dict[str, list[float]] = {
        key: [] for key in ("warm_ms", "sleep_ms", "wake_ms", "first_after_wake_ms")
    }
    with DiffusionEngine.make_engine(config) as engine:
        loaded = _device_bytes() if on_cuda else 0
        weights_awake = sum(engine.collective_rpc("device_weight_bytes"))
        rss_awake = rss_asleep = device_asleep = weights_asleep = 0
        for _ in range(rounds):
            samples["warm_ms"].append(_ms(lambda: _generate(engine, prompts, params)))
            rss_awake = _rss_bytes()
            samples["sleep_ms"].append(_ms(lambda: engine.sleep(level)))
            weights_asleep = sum(engine.collective_rpc("device_weight_bytes"))
            rss_asleep = _rss_bytes()
            device_asleep = _device_bytes() if on_cuda else 0
            samples["wake_ms"].append(_ms(engine.wake_up))
            samples["first_after_wake_ms"].append(_ms(lambda: _generate(engine, prompts, params)))
    medians = {key: round(statistics.median(values), 2) for key, values in samples.items()}
    row: dict[str, Any] = {
        **medians,
        "first_after_wake_over_warm": round(medians["first_after_wake_ms"] / medians["warm_ms"], 2),
        "weight_bytes_awake": weights_awake,
        "weight_bytes_asleep": weights_asleep,
    }
    if on_cuda:
        row["device_bytes"] = {"before_engine": before, "loaded": loaded, "asleep": device_asleep}
        row["asleep_within_5pct_of_baseline"] = (
            device_asleep - before <= DEVICE_MEMORY_TOLERANCE * (loaded - before)
        )
    else:
        row["rss_bytes_awake"] = rss_awake
        row["rss_bytes_asleep"] = rss_asleep
    return row


def _generate(engine: DiffusionEngine, prompts: list[str], params: SamplingParams) -> None:
    outputs = engine.generate(prompts, params)
    failed = [output.error for output in outputs if not output.ok]
    if failed:
        raise RuntimeError(f"a benchmark request failed: {failed[0]}")


def _ms(fn: Callable[[], object]) -> float:
    watch = Stopwatch()
    fn()
    return watch.seconds() * 1e3


def _rss_bytes() -> int:
    """The process's resident set, from ``/proc/self/statm`` (0 where there is none)."""
    gc.collect()
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return 0
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_bytes() -> int:
    """Bytes this process's tensors hold on the CUDA device."""
    return device_memory_in_use()[0]
