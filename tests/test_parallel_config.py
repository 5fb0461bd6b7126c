"""The parallel degrees as a user sets them: config fields, executor and pipeline refusals, CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from test_cli import assert_refused, run_cli

from diffusion_runtime import EngineConfig, InvalidFieldError
from diffusion_runtime.pipelines.digits import DigitsPipeline
from diffusion_runtime.runner.parallel import check_parallel_degrees
from diffusion_runtime.testing.pipelines import SeededNoisePipeline


def test_num_workers_defaults_to_the_world_size() -> None:
    assert EngineConfig(device="cpu").num_workers == 1
    config = EngineConfig(device="cpu", cfg_parallel_size=2)
    assert (config.world_size, config.num_workers, config.resolved_backend) == (2, 2, "mp")
    assert config.joins_process_group
    assert EngineConfig(device="cpu", cfg_parallel_size=2, ulysses_degree=3).num_workers == 6
    # With every degree at 1, ranks still may replicate every wave (as before).
    assert EngineConfig(device="cpu", num_workers=2).world_size == 1


@pytest.mark.parametrize(
    ("overrides", "field", "rule"),
    [
        ({"cfg_parallel_size": 0}, "cfg_parallel_size", "integer in [1, 2]"),
        ({"cfg_parallel_size": 3}, "cfg_parallel_size", "integer in [1, 2]"),
        ({"ulysses_degree": 0}, "ulysses_degree", "integer in [1, 1024]"),
        ({"ring_degree": -1}, "ring_degree", "integer in [1, 1024]"),
        (
            {"cfg_parallel_size": 2, "num_workers": 3},
            "num_workers",
            "must equal cfg_parallel_size * ulysses_degree * ring_degree (2)",
        ),
        (
            {"ring_degree": 2, "executor_backend": "uni"},
            "executor_backend",
            "must be 'mp' or 'ray'",
        ),
    ],
)
def test_bad_degrees_are_refused_by_field(overrides: dict[str, Any], field: str, rule: str) -> None:
    with pytest.raises(InvalidFieldError) as refused:
        EngineConfig(device="cpu", **overrides)
    assert refused.value.field == field
    assert rule in str(refused.value)


def test_a_pipeline_refuses_the_degrees_it_does_not_declare() -> None:
    digits = DigitsPipeline("cpu")
    check_parallel_degrees(digits, EngineConfig(device="cpu", cfg_parallel_size=2))
    for field in ("ulysses_degree", "ring_degree"):
        with pytest.raises(InvalidFieldError, match="declares no sequence split") as refused:
            check_parallel_degrees(digits, EngineConfig(device="cpu", **{field: 2}))
        assert refused.value.field == field
    noise = SeededNoisePipeline("cpu")
    with pytest.raises(InvalidFieldError, match="declares no guidance branches") as no_cfg:
        check_parallel_degrees(noise, EngineConfig(device="cpu", cfg_parallel_size=2))
    assert no_cfg.value.field == "cfg_parallel_size"


def test_evolving_a_degree_needs_the_worker_count_to_follow() -> None:
    config = EngineConfig(device="cpu")
    with pytest.raises(InvalidFieldError, match="num_workers"):
        attrs.evolve(config, cfg_parallel_size=2)
    assert attrs.evolve(config, cfg_parallel_size=2, num_workers=2).world_size == 2


def test_the_cli_refuses_bad_degrees_in_one_line(tmp_path: Path) -> None:
    run = run_cli("generate", "--cfg-parallel-size", "3", "--device", "cpu", cwd=tmp_path)
    assert_refused(run, "EngineConfig.cfg_parallel_size must be an integer in [1, 2]; got 3")
    run = run_cli(
        "generate", "--cfg-parallel-size", "2", "--workers", "3", "--device", "cpu", cwd=tmp_path
    )
    assert_refused(run, "EngineConfig.num_workers must equal")
    run = run_cli("generate", "--ulysses-degree", "2", "--steps", "2", "--device", "cpu",
                  cwd=tmp_path)  # fmt: skip
    assert_refused(run, "EngineConfig.ulysses_degree must be 1 for DigitsPipeline")
