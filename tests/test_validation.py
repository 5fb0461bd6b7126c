from __future__ import annotations

import math
from typing import Any

import pytest

from diffusion_runtime import EngineConfig, InvalidFieldError, SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("num_inference_steps", 0, "integer in [1, 10000]"),
        ("num_inference_steps", -3, "integer in [1, 10000]"),
        ("num_inference_steps", 10_001, "integer in [1, 10000]"),
        ("num_inference_steps", 2.5, "integer"),
        ("num_inference_steps", True, "integer"),
        ("num_inference_steps", "20", "integer"),
        ("guidance_scale", math.nan, "finite number"),
        ("guidance_scale", math.inf, "finite number"),
        ("guidance_scale", -0.5, "finite number in [0.0"),
        ("guidance_scale", "7.5", "finite number"),
        ("seed", -1, "integer in [0,"),
        ("seed", 2**63, "integer in [0,"),
        ("seed", 1.0, "integer"),
        ("num_outputs_per_prompt", 0, "integer in [1, 256]"),
        ("height", 0, "integer in [1, 8192] or None"),
        ("width", 10**6, "integer in [1, 8192] or None"),
        ("extra_args", {1: "x"}, "dict with str keys"),
        ("extra_args", ["a"], "dict with str keys"),
    ],
)
def test_sampling_params_reject_bad_fields(field: str, value: Any, rule: str) -> None:
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert f"SamplingParams.{field}" in str(info.value)
    assert rule in str(info.value)


def test_sampling_params_defaults_and_batch_key() -> None:
    params = SamplingParams()
    assert params.seed is None and params.num_inference_steps > 0
    same = SamplingParams(seed=5, num_outputs_per_prompt=3)
    assert params.request_batch_key() == same.request_batch_key(), "seed and count may differ"
    assert params.request_batch_key() != SamplingParams(num_inference_steps=3).request_batch_key()
    assert (
        SamplingParams(extra_args={"a": [1]}).request_batch_key()
        != SamplingParams(extra_args={"a": [2]}).request_batch_key()
    )


def test_extra_args_are_copied() -> None:
    extra = {"k": 1}
    params = SamplingParams(extra_args=extra)
    extra["k"] = 2
    assert params.extra_args == {"k": 1}


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_num_seqs", 0, "integer in [1,"),
        ("max_num_seqs", "8", "integer"),
        ("max_waiting_requests", 0, "or None"),
        ("execution_mode", "batch", "must be one of 'request', 'step'"),
        ("executor_backend", "gpu", "'uni', 'mp'"),
        ("num_workers", 0, "integer in [1,"),
        ("request_batch_max_wait_ms", -1.0, "finite number"),
        ("request_batch_max_wait_ms", math.nan, "finite number"),
        ("device", "toaster", "torch device"),
        ("pipeline", "", "registered pipeline name"),
        ("pipeline", 42, "registered pipeline name"),
        ("warmup", 1, "bool"),
        ("worker_extensions", (3,), "classes or"),
        ("pipeline_kwargs", {1: 2}, "dict with str keys"),
    ],
)
def test_engine_config_rejects_bad_fields(field: str, value: Any, rule: str) -> None:
    with pytest.raises(InvalidFieldError) as info:
        EngineConfig(**{field: value})
    assert info.value.field == field
    assert f"EngineConfig.{field}" in str(info.value)
    assert rule in str(info.value)


def test_engine_config_defaults() -> None:
    config = EngineConfig()
    assert config.pipeline == "digits"
    assert config.device in ("cpu", "cuda")
    assert config.resolved_backend == "uni"
    assert EngineConfig(num_workers=2).resolved_backend == "mp"
