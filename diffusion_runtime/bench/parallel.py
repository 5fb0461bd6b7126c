"""Parallel ranks against one rank on the same machine: images/s, their ratio, CPU seconds.

For each workload (digits with guidance; the tiny DiT of ``bench dit`` at two
latent sizes, guided) the same requests, one image each with its own seed,
are served as one request-mode wave by engines side by side, timed in
interleaved rounds (the best round kept): degree 1 (the in-process executor,
torch on all ``threads``), degree 1 on ``threads // 2`` (what one rank of a
pair gets), ``cfg_parallel_size=2`` and, on the DiT, ``ulysses_degree=2`` and
``ring_degree=2`` (two mp ranks in one process group, ``threads // 2`` each).
Per workload: each side's images/s, each parallel side's speed-up over each
degree-1 side, the CPU seconds per image of the engine process and its
workers (Linux ``/proc``; other load on a shared machine barely moves them),
and the largest pixel difference between each parallel side's images and one
rank's (0 where rows are batch-invariant: digits always; the DiT runs without
``rows_per_call``, and its sequence split is within float rounding).

On CUDA every side gets the device: degree 1 on ``cuda:0``, the ranks on
``cuda:0`` and ``cuda:1``; with fewer than two devices the table is skipped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from diffusion_runtime.bench.stats import best_wall_and_cpu
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.diffusers.tiny import tiny_dit
from diffusion_runtime.sampling_params import SamplingParams

#: The workloads measured: digits, then the DiT at each latent side (images twice that).
WORKLOADS = ("digits", "dit-8", "dit-16")
GUIDANCE = 4.0
#: The parallel sides: each on two ranks, on every workload or the DiT only.
SPLITS = {"cfg_2": "cfg_parallel_size", "ulysses_2": "ulysses_degree", "ring_2": "ring_degree"}


def run(
    requests: int = 8,
    steps: int = 10,
    rounds: int = 3,
    workloads: Sequence[str] = WORKLOADS,
    threads: int | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = threads or torch.get_num_threads()
    result: dict[str, Any] = {
        "benchmark": "parallel",
        "device": device,
        "threads": threads,
        "requests": requests,
        "steps": steps,
        "guidance": GUIDANCE,
    }
    if device == "cuda" and torch.cuda.device_count() < 2:
        visible = torch.cuda.device_count()
        result["skipped"] = f"two ranks need 2 CUDA devices; {visible} visible"
        return result
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as root:
        result["workloads"] = {
            name: _compare(_pipeline(name, Path(root)), requests, steps, rounds, threads, device)
            for name in workloads
        }
    return result


def _pipeline(name: str, root: Path) -> dict[str, Any]:
    """The ``EngineConfig`` pipeline fields of workload ``name`` (a DiT saved under ``root``)."""
    if name == "digits":
        return {"pipeline": "digits"}
    side = name.removeprefix("dit-")
    if not side.isdigit() or not name.startswith("dit-"):
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    path = root / name
    tiny_dit(latent_size=int(side)).save_pretrained(path)
    return {"pipeline": "diffusers", "pipeline_kwargs": {"path": str(path)}}


def _compare(
    pipeline: dict[str, Any], requests: int, steps: int, rounds: int, threads: int, device: str
) -> dict[str, Any]:
    digits = pipeline["pipeline"] == "digits"
    prompts: list[Any] = [str(i % 10) if digits else i % 2 for i in range(requests)]
    params = [
        SamplingParams(num_inference_steps=steps, guidance_scale=GUIDANCE, seed=i)
        for i in range(requests)
    ]
    base = {**pipeline, "device": device, "max_num_seqs": requests, "execution_mode": "request"}
    half = max(1, threads // 2)
    configs = {
        "one_rank": EngineConfig(**base, intra_op_threads=threads),
        "one_rank_half_threads": EngineConfig(**base, intra_op_threads=half),
    }
    splits = ["cfg_2"] if digits else list(SPLITS)
    for side in splits:
        degree: dict[str, Any] = {SPLITS[side]: 2}
        configs[side] = EngineConfig(
            **base, **degree, intra_op_threads=half, worker_start_timeout_s=300.0
        )
    with ExitStack() as stack:
        engines = {
            name: stack.enter_context(DiffusionEngine.make_engine(c)) for name, c in configs.items()
        }
        images: dict[str, torch.Tensor] = {}

        def way(name: str) -> Callable[[], None]:
            def serve() -> None:
                outs = engines[name].generate(prompts, params)
                images[name] = _images(outs)

            return serve

        best = best_wall_and_cpu({name: way(name) for name in engines}, rounds, _tree_cpu_seconds)
    table: dict[str, Any] = {name: _figures(best[name], requests) for name in configs}
    for side in splits:
        split = best[side]
        for name in ("one_rank", "one_rank_half_threads"):
            table[f"{side}_over_{name}"] = round(best[name][0] / split[0], 2)
            table[f"cpu_s_{side}_over_{name}"] = round(split[1] / best[name][1], 2)
    table["max_abs_diff"] = {
        side: float((images[side] - images["one_rank"]).abs().max()) for side in splits
    }
    return table


def _images(outs: list[RequestOutput]) -> torch.Tensor:
    failed = [out.error for out in outs if not out.ok]
    if failed:
        raise RuntimeError(f"bench parallel: requests failed: {failed}")
    return torch.cat([out.image_batch for out in outs if out.image_batch is not None]).cpu()


def _figures(seconds: tuple[float, float], requests: int) -> dict[str, float]:
    wall, cpu = seconds
    return {"images_per_s": round(requests / wall, 2), "cpu_s_per_image": round(cpu / requests, 4)}


def _tree_cpu_seconds() -> float:
    """User + system CPU seconds so far of this process and its live descendants (Linux)."""
    usage: dict[int, tuple[int, float]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        usage[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    tree = {os.getpid()}
    grew = True
    while grew:
        children = {pid for pid, (parent, _) in usage.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(usage[pid][1] for pid in tree if pid in usage)
