"""TeaCache on digits: model evaluations saved, throughput and quality over thresholds.

One request-mode engine (uni executor, all requests in one wave) serves the
same requests, one image each of every digit in turn with fixed seeds, once
per threshold (``SamplingParams.cache`` per request; ``None`` is uncached).
Timings are interleaved rounds (the best round kept), so a slow spell of a
shared machine falls on every threshold alike; torch runs one thread, and
besides images per wall-clock second each variant reports images per second of
this process's CPU time, which other work on a shared machine barely moves.
Per threshold: the fraction of steps skipped, how many times fewer model
evaluations than uncached, images/s and the recognition rate of the digit
classifier.

Then a step-mode engine runs a mixed batch in which half the requests cache
(at ``mixed_thresh``) against the same requests all uncached.

Last, with ``dit_requests`` above 0, both backends on a tiny DiT with PSNR
against uncached as quality (:mod:`.cache_dit`, which needs the ``diffusers``
extra).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_runtime.bench.stats import best_wall_and_cpu
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.digits.classifier import recognition_rates
from diffusion_runtime.sampling_params import SamplingParams

THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8)


def _params(count: int, steps: int, cache: Any) -> list[SamplingParams]:
    return [SamplingParams(num_inference_steps=steps, seed=i, cache=cache) for i in range(count)]


def _cache(thresh: float | None) -> dict[str, float] | bool:
    return False if thresh is None else {"rel_l1_thresh": thresh}


def _engine(mode: str, size: int) -> DiffusionEngine:
    config = EngineConfig(
        pipeline="digits",
        device="cpu",
        max_num_seqs=size,
        execution_mode=mode,
        cache_backend="tea_cache",
        intra_op_threads=1,
    )
    return DiffusionEngine.make_engine(config)


def _run(
    engine: DiffusionEngine,
    prompts: list[Any],
    params: list[SamplingParams],
    keep: dict[str, list[RequestOutput]],
    name: str,
) -> None:
    outs = engine.generate(prompts, params)
    assert all(out.ok for out in outs), [out.error for out in outs if not out.ok]
    keep[name] = outs


def _counts(outs: Sequence[RequestOutput]) -> tuple[int, int]:
    """(model evaluations, cached steps) over ``outs``."""
    metrics = [out.metrics for out in outs if out.metrics is not None]
    return sum(m.model_evaluations for m in metrics), sum(m.cached_steps for m in metrics)


def run(
    requests: int = 100,
    steps: int = 25,
    rounds: int = 3,
    thresholds: Sequence[float] = THRESHOLDS,
    mixed_thresh: float = 0.3,
    dit_requests: int = 16,
    dit_steps: int = 25,
) -> dict[str, Any]:
    prompts = [str(i % 10) for i in range(requests)]
    labels = torch.tensor([i % 10 for i in range(requests)])
    names = ["uncached", *(f"{t:g}" for t in thresholds)]
    settings = [None, *thresholds]
    outputs: dict[str, list[RequestOutput]] = {}
    with _engine("request", requests) as engine:
        ways = {
            name: functools.partial(
                _run, engine, prompts, _params(requests, steps, _cache(t)), outputs, name
            )
            for name, t in zip(names, settings, strict=True)
        }
        seconds = best_wall_and_cpu(ways, rounds)
    uncached_evals, _ = _counts(outputs["uncached"])
    curve = {}
    for name in names:
        evaluations, cached = _counts(outputs[name])
        images = torch.cat(
            [out.image_batch for out in outputs[name] if out.image_batch is not None]
        )
        recognition, _ = recognition_rates(images, labels)
        curve[name] = {
            "skipped_fraction": round(cached / (evaluations + cached), 3),
            "fewer_evaluations": round(uncached_evals / evaluations, 2),
            "images_per_s": round(requests / seconds[name][0], 1),
            "images_per_cpu_s": round(requests / seconds[name][1], 1),
            "recognition": round(recognition, 3),
        }
    return {
        "benchmark": "cache",
        "requests": requests,
        "steps": steps,
        "curve": curve,
        "mixed_step_batch": _mixed(prompts, steps, rounds, mixed_thresh),
        "dit": _dit(dit_requests, dit_steps, rounds),
    }


def _dit(requests: int, steps: int, rounds: int) -> dict[str, Any] | None:
    """Both backends on the tiny DiT, or ``None`` when ``requests`` is 0."""
    if requests == 0:
        return None
    from diffusion_runtime.bench.cache_dit import run_dit  # it imports this module's helpers

    return run_dit(requests=requests, steps=steps, rounds=rounds)


def _mixed(prompts: list[str], steps: int, rounds: int, thresh: float) -> dict[str, Any]:
    """Images/s of a step batch where every other request caches, against none caching."""
    count = len(prompts)
    half = [_cache(thresh if i % 2 else None) for i in range(count)]
    mixed = [
        SamplingParams(num_inference_steps=steps, seed=i, cache=cache)
        for i, cache in enumerate(half)
    ]
    outputs: dict[str, list[RequestOutput]] = {}
    with _engine("step", count) as engine:
        ways = {
            "uncached": functools.partial(
                _run, engine, prompts, _params(count, steps, False), outputs, "uncached"
            ),
            "half_cached": functools.partial(_run, engine, prompts, mixed, outputs, "half_cached"),
        }
        seconds = best_wall_and_cpu(ways, rounds)
    evaluations, cached = _counts(outputs["half_cached"])
    return {
        "thresh": thresh,
        "images_per_s": {name: round(count / s[0], 1) for name, s in seconds.items()},
        "images_per_cpu_s": {name: round(count / s[1], 1) for name, s in seconds.items()},
        "cpu_speedup": round(seconds["uncached"][1] / seconds["half_cached"][1], 3),
        "skipped_fraction": round(cached / (evaluations + cached), 3),
    }
