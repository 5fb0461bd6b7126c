"""The LoRA benchmark runs end to end at tiny sizes (its numbers mean nothing here)."""

from __future__ import annotations

from pathlib import Path

import torch

from diffusion_runtime import DiffusionEngine, EngineConfig
from diffusion_runtime.bench.lora import batch_params, run, run_split, write_random_adapters
from diffusion_runtime.cli import BENCHMARKS


def test_the_lora_benchmark_reports_both_ways_and_the_adapter_cost() -> None:
    assert BENCHMARKS["lora"] == "diffusion_runtime.bench.lora:run"
    result = run(requests=3, adapters=2, rank=2, steps=2, rounds=1, cost_batches=(2,))
    mixed = result["mixed_vs_split"]
    assert set(mixed["requests_per_s"]) == {"mixed", "split"}
    assert mixed["mixed_over_split"] > 0
    [cost] = result["adapter_cost_by_batch"].values()
    assert set(cost["median_ms"]) == {"base_lora_off", "base_lora_on", "adapter"}
    assert all(value > 0 for value in cost["median_ms"].values())


def test_split_waves_give_the_images_of_the_mixed_batch(tmp_path: Path) -> None:
    """Both ways serve the same requests: each row is bit-identical whatever its batch."""
    loras = write_random_adapters(tmp_path, 2, rank=2)
    params = batch_params([None, loras[0], loras[1], loras[0]], steps=3)
    prompts = ["1", "2", "3", "4"]
    config = EngineConfig(
        pipeline="digits", device="cpu", execution_mode="step", max_num_seqs=4, max_loras=2
    )
    with DiffusionEngine.make_engine(config) as engine:
        mixed = engine.generate(prompts, params)
        split = run_split(engine, prompts, params)
    for together, alone in zip(mixed, split, strict=True):
        assert together.ok and alone.ok
        assert torch.equal(together.image_batch, alone.image_batch)
