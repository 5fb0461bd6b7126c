"""What Ray costs and what replicas buy, measured side by side in one run.

- ``wave``: one request-mode wave of 8 requests with ``testing-null`` (no
  compute) through ``execute``: uni, mp and Ray, one worker each, and mp and
  Ray with two workers (every rank runs every wave): the per-wave cost of
  each transport.
- ``admission``: one admission check (``validate_request``, answered by rank
  0 beside any running wave), mp against Ray.
- ``digits``: requests per second of the digits engine with the mp and the
  Ray executor, 1 and 2 workers (one torch thread each), measured in
  alternation so that load drift hits both; uni with one worker as the floor.
  ``waves``: the executors alone, ms per 8-request wave (``ray_over_mp`` is
  a throughput ratio: mp's time over Ray's).
- ``replicas``: 1, 2 and 4 replicas (each a digits engine with one torch
  thread, in a Ray actor) under one open-loop Poisson load, the sets run in
  alternation: throughput and p99 latency, medians over repeats. The load's
  rate is set from one replica's measured capacity, so that it needs more
  than one replica.

The machine's core count is part of the result: replicas cannot scale past it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import random
import statistics
from collections.abc import Callable
from typing import Any

import ray

from diffusion_runtime.bench import interleaved_generate_rates
from diffusion_runtime.bench.stats import (
    Stopwatch,
    call_seconds,
    interleaved_seconds,
    percentile,
    summary_us,
)
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import NewRequestData, SchedulerOutput
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.executor.mp import MultiprocExecutor
from diffusion_runtime.executor.ray import RayExecutor
from diffusion_runtime.executor.uni import UniProcExecutor
from diffusion_runtime.replicas import ReplicaSet, ReplicaSetConfig
from diffusion_runtime.sampling_params import SamplingParams


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# -- per-wave overhead -----------------------------------------------------------------


def wave_overhead(count: int) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=1)
    numbers = itertools.count()

    def next_wave() -> SchedulerOutput:
        i = next(numbers)
        new = tuple(NewRequestData(f"{i}-{k}", "p", params, k) for k in range(8))
        return SchedulerOutput(i, new, (), (), 8, 0)

    variants: dict[str, tuple[type[DiffusionExecutor], int]] = {
        "uni": (UniProcExecutor, 1),
        "mp": (MultiprocExecutor, 1),
        "ray": (RayExecutor, 1),
        "mp_2_workers": (MultiprocExecutor, 2),
        "ray_2_workers": (RayExecutor, 2),
    }
    results: dict[str, Any] = {"requests_per_wave": 8, "pipeline": "testing-null"}
    for name, (cls, workers) in variants.items():
        config = EngineConfig(
            pipeline="testing-null", device="cpu", num_workers=workers, ray_cpus_per_worker=0.5
        )
        executor = cls(config)
        try:
            results[name] = summary_us(
                call_seconds(functools.partial(_execute_next, executor, next_wave), count, 20)
            )
        finally:
            executor.shutdown()
    for name in ("mp", "ray"):
        results[f"{name}_cost_over_uni"] = round(
            results[name]["median_us"] / results["uni"]["median_us"], 1
        )
    results["ray_cost_over_mp"] = round(results["ray"]["median_us"] / results["mp"]["median_us"], 2)
    return results


def admission_check(count: int) -> dict[str, Any]:
    """One ``validate_request`` (an admission check, answered by rank 0 beside any wave)."""
    params = SamplingParams(num_inference_steps=1)
    results: dict[str, Any] = {"pipeline": "testing-noise"}
    for name, cls in (("mp", MultiprocExecutor), ("ray", RayExecutor)):
        executor = cls(EngineConfig(pipeline="testing-noise", device="cpu"))
        try:
            check = functools.partial(executor.validate_request, "p", params)
            results[name] = summary_us(call_seconds(check, count, 20))
        finally:
            executor.shutdown()
    return results


def digits_waves(workers: int, waves: int, steps: int) -> dict[str, Any]:
    """ms per 8-request digits wave through ``execute``, mp and Ray in alternation
    (the executors alone: no admission, no engine loop)."""
    params = SamplingParams(num_inference_steps=steps, seed=0)
    config = EngineConfig(
        pipeline="digits",
        device="cpu",
        num_workers=workers,
        intra_op_threads=1,
        ray_cpus_per_worker=1,
    )
    executors: dict[str, DiffusionExecutor] = {
        "mp": MultiprocExecutor(config),
        "ray": RayExecutor(config),
    }
    numbers = itertools.count()

    def next_wave() -> SchedulerOutput:
        i = next(numbers)
        new = tuple(NewRequestData(f"{i}-{k}", k % 10, params, k) for k in range(8))
        return SchedulerOutput(i, new, (), (), 8, 0)

    ways = {
        name: functools.partial(_execute_next, executor, next_wave)
        for name, executor in executors.items()
    }
    try:
        samples = interleaved_seconds(ways, waves - 2, warmup_rounds=2)
    finally:
        for executor in executors.values():
            executor.shutdown()
    mp, ray_ms = (statistics.median(samples[name]) * 1e3 for name in ("mp", "ray"))
    return {"mp_ms": round(mp, 1), "ray_ms": round(ray_ms, 1), "ray_over_mp": round(mp / ray_ms, 3)}


def _execute_next(executor: DiffusionExecutor, next_wave: Callable[[], SchedulerOutput]) -> None:
    executor.execute(next_wave())


# -- digits throughput by executor -----------------------------------------------------


def digits_throughput(num_requests: int, repeats: int, steps: int) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps, seed=0)
    prompts = [i % 10 for i in range(num_requests)]
    cores = usable_cores()
    results: dict[str, Any] = {
        "requests": num_requests,
        "pipeline": f"digits, {steps} steps, max_num_seqs 8, 1 torch thread per worker",
    }
    for workers in (1, 2):
        backends = ("uni", "mp", "ray") if workers == 1 else ("mp", "ray")
        engines = {
            backend: DiffusionEngine.make_engine(
                EngineConfig(
                    pipeline="digits",
                    device="cpu",
                    executor_backend=backend,
                    num_workers=workers,
                    max_num_seqs=8,
                    # One torch thread everywhere: on 2 shared cores a 2-thread team was
                    # measured 3-15x slower and erratic, which would swamp the executors.
                    intra_op_threads=1,
                    ray_cpus_per_worker=max(1, cores // workers),
                )
            )
            for backend in backends
        }
        try:
            medians = interleaved_generate_rates(engines, prompts, params, repeats)
        finally:
            for engine in engines.values():
                engine.close()
        entry: dict[str, Any] = {
            f"{backend}_requests_per_s": round(rate, 1) for backend, rate in medians.items()
        }
        entry["ray_over_mp"] = round(medians["ray"] / medians["mp"], 3)
        entry["waves"] = digits_waves(workers, 12, steps)
        results[f"{workers}_workers"] = entry
    return results


# -- replica scaling under a Poisson load ----------------------------------------------


def replica_engine() -> EngineConfig:
    return EngineConfig(
        pipeline="digits", device="cpu", intra_op_threads=1, max_num_seqs=4, warmup=True
    )


async def _poisson_run(
    replicas: ReplicaSet, rate: float, num_requests: int, params: SamplingParams, seed: int
) -> tuple[float, list[float]]:
    """Send ``num_requests`` at Poisson arrivals of ``rate``/s; the makespan and latencies."""
    arrivals = random.Random(seed)
    latencies: list[float] = []

    async def one(prompt: int) -> None:
        sent = Stopwatch()
        rid = await replicas.add_request(prompt, params)
        async for output in replicas.stream(rid):
            if output.finished:
                assert output.ok, output.error
        latencies.append(sent.seconds())

    makespan = Stopwatch()
    tasks = []
    for i in range(num_requests):
        tasks.append(asyncio.create_task(one(i % 10)))
        await asyncio.sleep(arrivals.expovariate(rate))
    await asyncio.gather(*tasks)
    return makespan.seconds(), latencies


def replica_capacity(replicas: ReplicaSet, params: SamplingParams, count: int) -> float:
    """Requests per second of a closed burst (the queue never runs dry)."""
    watch = Stopwatch()
    outputs = replicas.generate([i % 10 for i in range(count)], params)
    assert all(o.ok for o in outputs)
    return count / watch.seconds()


def replica_scaling(
    counts: tuple[int, ...], num_requests: int, steps: int, overload: float, repeats: int
) -> dict[str, Any]:
    """Every replica set is built first; then each repeat runs the same Poisson load on
    each set in turn, so that the load other work puts on the machine hits all of them."""
    params = SamplingParams(num_inference_steps=steps, seed=0)
    results: dict[str, Any] = {
        "pipeline": f"digits, {steps} steps, 1 torch thread and max_num_seqs 4 per replica",
        "requests": num_requests,
        "routing": "power_of_two",
        "repeats": repeats,
    }
    sets = {
        count: ReplicaSet(
            ReplicaSetConfig(engine=replica_engine(), num_replicas=count, replica_cpus=0.25)
        )
        for count in counts
    }
    runs: dict[int, list[tuple[float, float]]] = {count: [] for count in counts}
    try:
        for replicas in sets.values():
            replica_capacity(replicas, params, 16)  # every replica warm
        rate = overload * replica_capacity(sets[counts[0]], params, 64)
        results["offered_requests_per_s"] = round(rate, 1)
        for repeat in range(repeats):
            for count, replicas in sets.items():
                makespan, latencies = asyncio.run(
                    _poisson_run(replicas, rate, num_requests, params, seed=repeat)
                )
                runs[count].append((num_requests / makespan, percentile(latencies, 99)))
    finally:
        for replicas in sets.values():
            replicas.close()
    for count, samples in runs.items():
        results[f"{count}_replicas"] = {
            "requests_per_s": round(statistics.median(rate for rate, _ in samples), 1),
            "p99_ms": round(statistics.median(p99 for _, p99 in samples) * 1e3, 1),
        }
    first = results[f"{counts[0]}_replicas"]["requests_per_s"]
    for count in counts[1:]:
        results[f"{count}_over_{counts[0]}"] = round(
            results[f"{count}_replicas"]["requests_per_s"] / first, 2
        )
    return results


def run(
    wave_samples: int = 300,
    digits_requests: int = 64,
    digits_repeats: int = 3,
    digits_steps: int = 20,
    replica_counts: tuple[int, ...] = (1, 2, 4),
    replica_requests: int = 120,
    replica_steps: int = 50,
    replica_repeats: int = 3,
    overload: float = 2.5,
) -> dict[str, Any]:
    """All three parts, on one local Ray started here (and stopped at the end)."""
    cores = usable_cores()
    ray.init(num_cpus=max(4, cores), include_dashboard=False, log_to_driver=False)
    try:
        return {
            "benchmark": "ray",
            "cores": cores,
            "ray": ray.__version__,
            "wave": wave_overhead(wave_samples),
            "admission": admission_check(wave_samples),
            "digits": digits_throughput(digits_requests, digits_repeats, digits_steps),
            "replicas": replica_scaling(
                replica_counts, replica_requests, replica_steps, overload, replica_repeats
            ),
        }
    finally:
        ray.shutdown()
