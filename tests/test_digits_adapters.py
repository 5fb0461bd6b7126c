"""The style adapters shipped with the digits model: they draw the asked digit, in their style."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diffusion_runtime import DiffusionEngine, LoRARequest, SamplingParams
from diffusion_runtime.lora.weights import load_adapter
from diffusion_runtime.pipelines.digits import LORA_ADAPTERS, DigitsPipeline, recognition_rates
from diffusion_runtime.pipelines.digits.styles import STYLES, bright_fraction
from diffusion_runtime.pipelines.digits.train import load_digits_data, train_adapter

SAMPLES_PER_DIGIT = 20
STEPS = 25
#: How much each style must raise the fraction of bright pixels over the base model.
MIN_BRIGHT_GAIN = {"bold": 0.08, "inverted": 0.25}


def sample_digits(engine: DiffusionEngine, lora: LoRARequest | None) -> torch.Tensor:
    """``SAMPLES_PER_DIGIT`` images of each digit 0-9, in digit order."""
    params = [
        SamplingParams(
            num_inference_steps=STEPS,
            seed=digit,
            num_outputs_per_prompt=SAMPLES_PER_DIGIT,
            lora=lora,
        )
        for digit in range(10)
    ]
    outputs = engine.generate([str(digit) for digit in range(10)], params)
    assert all(output.ok for output in outputs), [output.error for output in outputs]
    return torch.cat([output.image_batch for output in outputs])


def test_the_shipped_adapters_are_listed_and_load() -> None:
    assert sorted(LORA_ADAPTERS) == sorted(STYLES) == ["bold", "inverted"]
    shapes = {
        name: (m.in_features, m.out_features)
        for name, m in DigitsPipeline().model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    for path in LORA_ADAPTERS.values():
        weights = load_adapter(path, shapes, max_rank=16)
        assert set(weights.layers) == set(shapes), "every linear layer is adapted"
        assert path.stat().st_size < 600_000


def test_each_adapter_keeps_the_digit_and_changes_the_style(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("digits", max_loras=1, max_cpu_loras=2, max_num_seqs=10)
    labels = torch.arange(10).repeat_interleave(SAMPLES_PER_DIGIT)
    base = sample_digits(engine, None)
    base_rate, _ = recognition_rates(base, labels)
    assert base_rate >= 0.9
    for adapter_id, (name, path) in enumerate(sorted(LORA_ADAPTERS.items()), start=1):
        images = sample_digits(engine, LoRARequest(name, adapter_id, str(path)))
        rate, per_digit = recognition_rates(STYLES[name].read(images), labels)
        assert rate >= 0.9, (name, per_digit)
        gain = bright_fraction(images) - bright_fraction(base)
        assert gain >= MIN_BRIGHT_GAIN[name], (name, bright_fraction(base), gain)


def test_adapter_training_moves_only_the_low_rank_matrices() -> None:
    pytest.importorskip("sklearn")
    base = DigitsPipeline().model
    before = {key: value.clone() for key, value in base.state_dict().items()}
    pixels, labels = load_digits_data()
    layers = train_adapter(base, pixels, labels, STYLES["inverted"], rank=2, steps=3, seed=0)
    assert all(torch.equal(before[key], value) for key, value in base.state_dict().items())
    assert all(a.shape[0] == b.shape[1] == 2 for a, b in layers.values())
    assert all(b.abs().max() > 0 for _, b in layers.values()), "B leaves zero once trained"


def test_the_docs_example_draws_each_style(capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).parent.parent / "docs" / "lora.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "LORA_ADAPTERS" in b]
    exec(compile(block, "docs/lora.md", "exec"), {})
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [name for name, _ in lines] == ["None", "bold", "inverted"]
    base, bold, inverted = (float(share) for _, share in lines)
    assert base < bold < inverted
