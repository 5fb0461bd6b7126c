"""Host offload of preempted step state: the step time with and without it.

One workload runs on engine cores built alike except for
``EngineConfig.preempted_offload_bytes``: ``off`` (0), its twin ``off_twin``
(how far two identical cores differ: the noise floor of the ratios),
``none_fit`` (1 byte: every preempted state is measured and none fits) and
``all_fit`` (every preempted state goes to host memory and comes back). The
workload: ``requests`` digit requests of ``low_steps`` steps run for three
steps, then as many better-ranked ones of ``high_steps`` steps preempt them
all (priority policy, step mode), and everything runs to the end. Rounds
interleave the cores; each keeps its best round, in CPU time of the driving
thread per step. On the CPU nothing is copied, so the ratios are the cost of
the bookkeeping; with ``device="cuda"`` they include the copies.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch

from diffusion_runtime.bench.stats import Stopwatch
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineCore
from diffusion_runtime.sampling_params import SamplingParams

BUDGETS = {"off": 0, "off_twin": 0, "none_fit": 1, "all_fit": 2**40}


def run(
    requests: int = 4,
    low_steps: int = 25,
    high_steps: int = 20,
    repeats: int = 7,
    device: str = "cpu",
) -> dict[str, Any]:
    low = SamplingParams(num_inference_steps=low_steps, priority=5)
    high = SamplingParams(num_inference_steps=high_steps)
    base = EngineConfig(
        pipeline="digits",
        device=device,
        execution_mode="step",
        scheduling_policy="priority",
        max_num_seqs=requests,
        intra_op_threads=1,
        warmup=False,
    )
    cores = {
        name: EngineCore(attrs.evolve(base, preempted_offload_bytes=budget))
        for name, budget in BUDGETS.items()
    }
    best_s = dict.fromkeys(cores, float("inf"))
    images: dict[str, list[torch.Tensor]] = {}
    offloaded: dict[str, int] = {}
    try:
        for round_index in range(repeats):
            for name, core in cores.items():
                seconds, lows, held = _round(core, f"{round_index}-", requests, low, high)
                best_s[name] = min(best_s[name], seconds)
                images.setdefault(name, lows)
                offloaded.setdefault(name, held)
    finally:
        for core in cores.values():
            core.shutdown()
    reference = images["off"]
    return {
        "benchmark": "offload",
        "device": device,
        "requests": requests,
        "low_steps": low_steps,
        "high_steps": high_steps,
        "best_cpu_us_per_step": {name: round(s * 1e6, 1) for name, s in best_s.items()},
        **{f"{name}_step_time_vs_off": round(best_s[name] / best_s["off"], 3) for name in BUDGETS},
        "offloaded_while_preempted": offloaded,
        "images_identical": all(
            all(torch.equal(a, b) for a, b in zip(lows, reference, strict=True))
            for lows in images.values()
        ),
    }


def _round(
    core: EngineCore, prefix: str, requests: int, low: SamplingParams, high: SamplingParams
) -> tuple[float, list[torch.Tensor], int]:
    """CPU seconds per step, the low requests' images, and how many states were
    offloaded once all low requests were preempted."""
    low_ids = [f"{prefix}low{i}" for i in range(requests)]
    for index, request_id in enumerate(low_ids):
        core.add_request(request_id, str(index % 10), low, seed=index)
    steps, images = 0, {}
    cpu = Stopwatch(time.thread_time)
    held = 0
    while core.has_unfinished():
        if steps == 3:
            for index in range(requests):
                core.add_request(f"{prefix}high{index}", "9", high, seed=index)
        for output in core.step().outputs:
            if output.finished and output.image_batch is not None:
                images[output.request_id] = output.image_batch
        steps += 1
        if steps == 4:
            held = len(core.snapshot().runner_offloaded_ids)
    seconds = cpu.seconds() / steps
    return seconds, [images[request_id] for request_id in low_ids], held
