"""The built-in digits pipeline: sample quality, batch independence, modes, validation, training."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.digits import DigitClassifier, DigitsPipeline, recognition_rate
from diffusion_runtime.pipelines.digits.train import main as train_main
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepPipeline, StepRequestState
from diffusion_runtime.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe() -> DigitsPipeline:
    return DigitsPipeline()


def request(
    rid: str,
    prompt: object = "7",
    seed: int = 0,
    steps: int = 8,
    guidance: float = 1.0,
    n: int = 1,
    size: int | None = None,
) -> PipelineRequest:
    params = SamplingParams(
        num_inference_steps=steps,
        guidance_scale=guidance,
        num_outputs_per_prompt=n,
        height=size,
        width=size,
    )
    return PipelineRequest(rid, prompt, params, seed, CPU)


def others(count: int, steps: int = 8, guidance: float = 1.0) -> list[PipelineRequest]:
    """Batch mates with varied prompts, seeds and output counts."""
    return [
        request(f"o{i}", str(i % 10), 1000 + i, steps, guidance, n=1 + i % 3) for i in range(count)
    ]


def run_steps(pipe: DigitsPipeline, states: Sequence[StepRequestState]) -> None:
    live = [s for s in states if not s.is_done]
    for state, eps in zip(live, pipe.denoise_step(live), strict=True):
        pipe.step_scheduler(state, eps)


def test_samples_are_recognised_as_the_requested_digit(pipe: DigitsPipeline) -> None:
    overall, per_digit = recognition_rate(
        pipe, samples_per_digit=10, num_inference_steps=20, seed=0
    )
    assert overall >= 0.9, per_digit
    assert min(per_digit.values()) >= 0.7, per_digit


def test_classifier_recognises_real_digits() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    data = datasets.load_digits()
    images = torch.tensor(data.data / 16, dtype=torch.float32).reshape(-1, 1, 8, 8)
    predicted = DigitClassifier.load().predict(images)
    assert (predicted == torch.tensor(data.target)).float().mean().item() >= 0.95


def test_network_rows_do_not_depend_on_batch_size(pipe: DigitsPipeline) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 64, generator=gen)
    t = torch.randint(1000, (70,), generator=gen)
    labels = torch.randint(11, (70,), generator=gen)
    predict = pipe.model.predict_noise_row_stable
    alone = torch.cat(
        [predict(x[i : i + 1], t[i : i + 1], labels[i : i + 1], 32) for i in range(70)]
    )
    for m in range(2, 71):
        for start in {0, 70 - m}:
            part = slice(start, start + m)
            assert torch.equal(predict(x[part], t[part], labels[part], 32), alone[part]), (m, start)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_request_output_is_independent_of_batch_mates(
    pipe: DigitsPipeline, guidance: float
) -> None:
    def target() -> PipelineRequest:  # fresh each time: a request's generator is stateful
        return request("t", "3", seed=42, guidance=guidance, n=2)

    alone = pipe.forward([target()])["t"]
    for size in (2, 3, 7, 16, 33):
        mates = others(size - 1, guidance=guidance)
        for position in {0, len(mates) // 2, len(mates)}:
            batch = [*mates[:position], target(), *mates[position:]]
            assert torch.equal(pipe.forward(batch)["t"], alone), (size, position)


def test_step_mode_matches_request_mode_with_mates_at_other_steps(pipe: DigitsPipeline) -> None:
    assert isinstance(pipe, StepPipeline)
    expected = pipe.forward([request("t", 5, seed=7, steps=6, guidance=2.5, n=3)])["t"]

    mates = [
        pipe.prepare_encode(request(f"m{i}", i, 100 + i, steps=4 + 3 * i, guidance=g, n=1 + i))
        for i, g in zip(range(5), itertools.cycle([1.0, 4.0]), strict=False)
    ]
    for _ in range(3):  # the mates are mid-way through when the target joins
        run_steps(pipe, mates)
    state = pipe.prepare_encode(request("t", 5, seed=7, steps=6, guidance=2.5, n=3))
    assert pipe.preview(state) is None
    states = [*mates, state]
    while not state.is_done:
        run_steps(pipe, states)
        preview = pipe.preview(state)
        assert preview is not None and preview.shape == (3, 1, 8, 8)
    assert state.step_index == 6
    assert torch.equal(pipe.post_decode(state), expected)


def test_same_seed_same_images_and_different_seeds_differ(pipe: DigitsPipeline) -> None:
    first = pipe.forward([request("a", seed=1)])["a"]
    again = DigitsPipeline().forward([request("a", seed=1)])["a"]
    other = pipe.forward([request("a", seed=2)])["a"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_num_outputs_per_prompt(pipe: DigitsPipeline) -> None:
    images = pipe.forward([request("a", n=5)])["a"]
    assert images.shape == (5, 1, 8, 8)
    assert images.dtype == torch.float32
    assert images.min().item() >= 0.0 and images.max().item() <= 1.0
    assert len({tuple(img.flatten().tolist()) for img in images}) == 5


def test_size_is_a_pure_nearest_neighbour_upscale(pipe: DigitsPipeline) -> None:
    small = pipe.forward([request("a", seed=3, n=2)])["a"]
    big = pipe.forward([request("a", seed=3, n=2, size=32)])["a"]
    assert big.shape == (2, 1, 32, 32)
    assert torch.equal(big, small.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3))


@pytest.mark.parametrize("prompt", ["x", "12", 3.5, None, -1, 10, True, "", [3]])
def test_rejects_non_digit_prompts(pipe: DigitsPipeline, prompt: object) -> None:
    with pytest.raises(InvalidFieldError) as err:
        pipe.validate_request(prompt, SamplingParams())
    assert err.value.field == "prompt"


@pytest.mark.parametrize("prompt", [0, 9, "0", " 7\n"])
def test_accepts_digit_prompts(pipe: DigitsPipeline, prompt: object) -> None:
    pipe.validate_request(prompt, SamplingParams(num_inference_steps=1000, height=512, width=512))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(num_inference_steps=1001), "num_inference_steps"),
        (SamplingParams(guidance_scale=20.5), "guidance_scale"),
        (SamplingParams(height=12, width=12), "height"),
        (SamplingParams(height=520, width=520), "height"),
        (SamplingParams(height=16, width=24), "width"),
        (SamplingParams(height=16), "width"),
        (SamplingParams(width=4), "width"),
    ],
)
def test_rejects_bad_parameters(pipe: DigitsPipeline, params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidFieldError) as err:
        pipe.validate_request("1", params)
    assert err.value.field == field


def test_warmup_request_is_valid_and_runs(pipe: DigitsPipeline) -> None:
    prompt, params = pipe.warmup_request()
    pipe.validate_request(prompt, params)
    out = pipe.forward([PipelineRequest("w", prompt, params, params.seed or 0, CPU)])
    assert out["w"].shape == (1, 1, 8, 8)


def test_close_drops_the_model() -> None:
    closing = DigitsPipeline()
    closing.close()
    with pytest.raises(RuntimeError, match="closed"):
        closing.forward([request("a")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda() -> None:
    gpu = torch.device("cuda")
    params = SamplingParams(num_inference_steps=4, guidance_scale=2.0, num_outputs_per_prompt=2)
    out = DigitsPipeline(gpu).forward([PipelineRequest("g", "4", params, 0, gpu)])["g"]
    assert out.device.type == "cuda" and out.shape == (2, 1, 8, 8)


def test_training_is_deterministic_and_loadable(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    threads = str(torch.get_num_threads())
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        train_main([
            "--steps", "3", "--adapter-steps", "2", "--rank", "2", "--seed", "5",
            "--threads", threads, "--out", str(out),
        ])  # fmt: skip
    names = sorted(p.name for p in runs[0].iterdir())
    assert names == [
        "classifier.safetensors",
        "denoiser.json",
        "denoiser.safetensors",
        "lora-bold.safetensors",
        "lora-inverted.safetensors",
    ]
    for name in names:
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    trained = DigitsPipeline(weights_dir=str(runs[0]))
    assert trained.forward([request("a", steps=2)])["a"].shape == (1, 1, 8, 8)
