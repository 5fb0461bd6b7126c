"""The built-in digits pipeline through the engine and the command line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import suite_device
from hypothesis import given, settings

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.cli import main
from diffusion_runtime.testing.strategies import digit_prompts, request_mixes, sampling_params


@pytest.fixture(scope="module", params=["request", "step"])
def engine(request: pytest.FixtureRequest) -> Iterator[DiffusionEngine]:
    config = EngineConfig(
        pipeline="digits", device=suite_device(), max_num_seqs=16, execution_mode=request.param
    )
    with DiffusionEngine.make_engine(config) as engine:
        yield engine


MIXES = request_mixes(
    digit_prompts(),
    sampling_params(steps=(2, 6), outputs=(1, 3), guidance=[1.0, 3.0], sizes=[None, 16]),
    max_size=6,
)


@settings(max_examples=12, deadline=None)
@given(mix=MIXES)
def test_each_image_is_bit_identical_to_the_request_run_alone(
    engine: DiffusionEngine, mix: list[tuple[Any, SamplingParams]]
) -> None:
    prompts = [prompt for prompt, _ in mix]
    together = engine.generate(prompts, [params for _, params in mix])
    for (prompt, params), out in zip(mix, together, strict=True):
        [alone] = engine.generate([prompt], params)
        assert out.ok and alone.ok
        assert out.image_batch is not None and alone.image_batch is not None
        assert torch.equal(out.image_batch, alone.image_batch), (prompt, params)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("x", SamplingParams(), "prompt"),
        ("12", SamplingParams(), "prompt"),
        ("3", SamplingParams(num_inference_steps=5_000), "num_inference_steps"),
        ("3", SamplingParams(height=12, width=12), "height"),
        ("3", SamplingParams(guidance_scale=500.0), "guidance_scale"),
    ],
)
def test_bad_input_names_the_field_and_costs_nothing(
    engine: DiffusionEngine, prompt: Any, params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidFieldError) as info:
        engine.generate(["1", prompt], params)
    assert info.value.field == field
    assert engine.generate(["1"], SamplingParams(num_inference_steps=2, seed=0))[0].ok
    assert not engine.snapshot().scheduler_ids


def test_eval_command_recognises_the_requested_digits(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["eval", "--samples", "5", "--steps", "20", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["recognised"] >= 0.9
    assert set(report["per_digit"]) == {str(d) for d in range(10)}


def test_generate_command_writes_the_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", "--out", str(tmp_path), "--steps", "10", "--device", "cpu"])
    summary = capsys.readouterr().out
    assert code == 0
    assert "10 requests, 10 images" in summary
    assert (tmp_path / "grid.png").exists()
    assert len(list(tmp_path.glob("0*-*-0.png"))) == 10


def test_generate_command_reports_bad_input_without_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["generate", "x", "--out", str(tmp_path), "--device", "cpu"])
    assert code == 2
    assert "DigitsPipeline.prompt" in capsys.readouterr().err
