"""The diffusers adapter: equal to diffusers' own output, batching, refusal, lazy import, lifecycle.

The pipelines are tiny random-weight models built from config (see
``diffusers_models``); nothing is downloaded. Every test that needs diffusers
skips when it is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from conftest import engine_threads, factory_of, suite_device
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from diffusion_runtime import DiffusionEngine, EngineConfig, RequestOutput, SamplingParams
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.diffusers import (
    SUPPORTED_PIPELINES,
    DiffusersPipeline,
    UnsupportedPipelineError,
    from_pretrained_dir,
)
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepRequestState
from diffusion_runtime.testing.harness import lifecycle_machine
from diffusion_runtime.testing.strategies import sampling_params

Build = Callable[..., DiffusionEngine]
# Raised inside diffusers' sigma schedulers under numpy 2 (not by the runtime).
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
CPU = torch.device("cpu")
#: How far batch mates may move a pixel when the denoiser runs on all rows at once
#: (CPU GEMM kernels are chosen by row count), and how far fixed-size chunks
#: (``rows_per_call``) are from diffusers' own output, for these models and step counts.
ROUNDING_ATOL = 2e-5


@pytest.fixture(scope="module")
def pipes(models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny pipeline per family, built once (their weights are never changed)."""
    dit = models.dit_pipeline()
    sd = models.stable_diffusion_pipeline(tmp_path_factory.mktemp("tokenizer"))
    return {
        "ddim": models.ddim_pipeline(),
        "ddpm": models.ddpm_pipeline(),
        "dit": dit,
        "dit-dpm": models.with_scheduler(dit, "DPMSolverMultistepScheduler"),
        "sd": sd,
        "sd-euler": models.with_scheduler(sd, "EulerDiscreteScheduler"),
        "sd-euler-ancestral": models.with_scheduler(sd, "EulerAncestralDiscreteScheduler"),
        "sd-heun": models.with_scheduler(sd, "HeunDiscreteScheduler"),
    }


def reference(pipe: Any, seed: int, device: str = "cpu", **kwargs: Any) -> torch.Tensor:
    """What diffusers itself produces with a fresh generator on ``device`` seeded with ``seed``."""
    generator = torch.Generator(device).manual_seed(seed)
    images: torch.Tensor = pipe(generator=generator, output_type="pt", **kwargs).images
    return images


def request(rid: str, prompt: Any, params: SamplingParams, seed: int) -> PipelineRequest:
    return PipelineRequest(rid, prompt, params, seed, CPU)


def forward_alone(
    adapter: DiffusersPipeline, prompt: Any, params: SamplingParams, seed: int
) -> torch.Tensor:
    return adapter.forward([request("alone", prompt, params, seed)])["alone"]


def not_saturated(images: torch.Tensor) -> bool:
    """Most pixels strictly inside (0, 1), so that equality is not equality of clamped values."""
    return ((images > 0) & (images < 1)).float().mean().item() > 0.5


# -- importing the runtime never imports diffusers -----------------------------------------


def test_importing_any_runtime_module_imports_neither_diffusers_nor_transformers() -> None:
    script = (
        "import importlib, pkgutil, sys\n"
        "import diffusion_runtime\n"
        "for m in pkgutil.walk_packages(diffusion_runtime.__path__, 'diffusion_runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(sorted(n for n in ('diffusers', 'transformers') if n in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"


# -- refusal -------------------------------------------------------------------------------


def test_unsupported_objects_are_refused_naming_what_is_supported(pipes: dict[str, Any]) -> None:
    ddim_class = type(pipes["ddim"])

    class Custom(ddim_class):
        """A subclass may override __call__, so it is refused too."""

    custom = Custom(unet=pipes["ddim"].unet, scheduler=pipes["ddim"].scheduler)
    for obj in (object(), custom):
        with pytest.raises(UnsupportedPipelineError) as info:
            DiffusersPipeline(obj)
        message = str(info.value)
        assert all(name in message for name in SUPPORTED_PIPELINES)
        assert "carry inputs or state across steps" in message
    assert SUPPORTED_PIPELINES == (
        "DDIMPipeline",
        "DDPMPipeline",
        "DiTPipeline",
        "StableDiffusionPipeline",
    )


def test_a_stable_diffusion_unet_with_a_guidance_embedding_is_refused(
    models: Any, tmp_path: Path
) -> None:
    pipe = models.stable_diffusion_pipeline(tmp_path, time_cond_proj_dim=8)
    with pytest.raises(UnsupportedPipelineError, match="time_cond_proj_dim"):
        DiffusersPipeline(pipe)


@pytest.mark.parametrize("family", ["ddpm", "dit"])
def test_a_loop_that_never_scales_the_noise_refuses_a_sigma_scaled_scheduler(
    models: Any, pipes: dict[str, Any], family: str
) -> None:
    pipe = models.with_scheduler(pipes[family], "EulerDiscreteScheduler")
    with pytest.raises(UnsupportedPipelineError, match="init_noise_sigma"):
        DiffusersPipeline(pipe)


def test_a_saved_unsupported_pipeline_is_refused_before_loading(
    models: Any, tmp_path: Path
) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(UnsupportedPipelineError, match="'FluxPipeline' is not supported"):
        from_pretrained_dir("cpu", str(tmp_path))
    with pytest.raises(InvalidFieldError, match="save_pretrained"):
        from_pretrained_dir("cpu", str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("family", "prompt", "params", "field"),
    [
        ("ddim", "a cat", SamplingParams(), "prompt"),
        ("ddim", None, SamplingParams(guidance_scale=2.0), "guidance_scale"),
        ("ddim", None, SamplingParams(height=32), "height"),
        ("ddim", None, SamplingParams(extra_args={"eta": 2.0}), "extra_args['eta']"),
        ("ddpm", None, SamplingParams(extra_args={"eta": 0.5}), "extra_args"),
        ("ddpm", None, SamplingParams(num_inference_steps=1001), "num_inference_steps"),
        ("dit", 1000, SamplingParams(), "prompt"),
        ("dit", "unknown label", SamplingParams(), "prompt"),
        ("dit", True, SamplingParams(), "prompt"),
        ("dit", 3, SamplingParams(width=8), "width"),
        ("sd", 3, SamplingParams(), "prompt"),
        ("sd", {"prompt": "a", "negative": "b"}, SamplingParams(), "prompt"),
        ("sd", "a cat", SamplingParams(height=20), "height"),
        ("sd", "a cat", SamplingParams(extra_args={"strength": 0.5}), "extra_args"),
    ],
)
def test_requests_a_pipeline_cannot_serve_are_refused_naming_the_field(
    pipes: dict[str, Any], family: str, prompt: Any, params: SamplingParams, field: str
) -> None:
    adapter = DiffusersPipeline(pipes[family])
    with pytest.raises(InvalidFieldError) as info:
        adapter.validate_request(prompt, params)
    assert info.value.field == field


# -- equality with diffusers ---------------------------------------------------------------

EQUALITY_CASES = [
    # (family, runtime prompt, runtime params, diffusers keyword arguments)
    ("ddim", None, dict(num_outputs_per_prompt=2), dict(batch_size=2)),
    ("ddim", "", dict(extra_args={"eta": 0.5}), dict(eta=0.5)),
    ("ddpm", None, {}, {}),
    (
        "dit",
        1,
        dict(guidance_scale=4.0, num_outputs_per_prompt=2),
        dict(class_labels=[1, 1], guidance_scale=4.0),
    ),
    ("dit", "goldfish", {}, dict(class_labels=[1], guidance_scale=1.0)),
    ("dit-dpm", 7, dict(guidance_scale=2.0), dict(class_labels=[7], guidance_scale=2.0)),
    (
        "sd",
        "a cat",
        dict(guidance_scale=3.0, num_outputs_per_prompt=2),
        dict(prompt="a cat", guidance_scale=3.0, num_images_per_prompt=2),
    ),
    (
        "sd",
        "a cat",
        dict(height=24, width=32),
        dict(prompt="a cat", guidance_scale=1.0, height=24, width=32),
    ),
    # Sigma-scaled noise and inputs (init_noise_sigma, scale_model_input).
    ("sd-euler", "a b", dict(guidance_scale=3.0), dict(prompt="a b", guidance_scale=3.0)),
    # A second-order scheduler: two denoiser calls per step (5 runtime steps for 3).
    ("sd-heun", "a b", {}, dict(prompt="a b", guidance_scale=1.0)),
    # A stochastic step drawing from the request's generator.
    (
        "sd-euler-ancestral",
        "a b",
        dict(guidance_scale=2.0, num_outputs_per_prompt=2),
        dict(prompt="a b", guidance_scale=2.0, num_images_per_prompt=2),
    ),
    (
        "sd",
        {"prompt": "a cat", "negative_prompt": "dog"},
        dict(guidance_scale=5.0, extra_args={"eta": 1.0}),
        dict(prompt="a cat", negative_prompt="dog", guidance_scale=5.0, eta=1.0),
    ),
]


@pytest.mark.parametrize(
    ("family", "prompt", "params", "diffusers_kwargs"),
    EQUALITY_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(EQUALITY_CASES)],
)
def test_a_request_alone_equals_diffusers_bit_for_bit_in_both_modes(
    make_engine: Build,
    pipes: dict[str, Any],
    family: str,
    prompt: Any,
    params: dict[str, Any],
    diffusers_kwargs: dict[str, Any],
) -> None:
    device, seed, steps = suite_device(), 11, 3
    # Moved to the suite's device, a copy: the module's pipelines stay on the CPU.
    pipe = pipes[family] if device == "cpu" else copy.deepcopy(pipes[family]).to(device)
    expected = reference(pipe, seed, num_inference_steps=steps, device=device, **diffusers_kwargs)
    assert not_saturated(expected)
    sampling = SamplingParams(num_inference_steps=steps, seed=seed, **params)
    for mode in ("request", "step"):
        adapter = DiffusersPipeline(pipe, device)
        engine = make_engine(factory_of(adapter), execution_mode=mode, warmup=False, device=device)
        [out] = engine.generate([prompt], sampling)
        assert out.ok, out.error
        assert out.image_batch is not None
        assert torch.equal(out.image_batch, expected.cpu()), mode


ROUNDING_CASES = {
    "ddim": (None, {}, {}),
    "dit": (3, dict(guidance_scale=2.0), dict(class_labels=[3], guidance_scale=2.0)),
    "sd": ("x", dict(guidance_scale=2.0), dict(prompt="x", guidance_scale=2.0)),
}


@pytest.mark.parametrize("family", sorted(ROUNDING_CASES))
def test_fixed_size_denoiser_calls_stay_within_rounding_of_diffusers(
    pipes: dict[str, Any], family: str
) -> None:
    prompt, params, diffusers_kwargs = ROUNDING_CASES[family]
    expected = reference(pipes[family], 5, num_inference_steps=3, **diffusers_kwargs)
    adapter = DiffusersPipeline(pipes[family], rows_per_call=8)
    got = forward_alone(adapter, prompt, SamplingParams(num_inference_steps=3, **params), 5)
    torch.testing.assert_close(got, expected, atol=ROUNDING_ATOL, rtol=0)


# -- batching across requests --------------------------------------------------------------


class GatedAdapter(DiffusersPipeline):
    """Records each step's ``(request id, step index)`` pairs, and can hold one step.

    While :attr:`hold` is set, the first step in which a request reaches step
    index 2 sets :attr:`entered` and waits for :attr:`release`, so a test can
    add requests while it runs.
    """

    def __init__(self, pipe: Any, **kwargs: Any) -> None:
        super().__init__(pipe, **kwargs)
        self.steps: list[list[tuple[str, int]]] = []
        self.hold = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def step_batch(self, states: Sequence[StepRequestState]) -> None:
        self.steps.append([(s.request_id, s.step_index) for s in states])
        if self.hold.is_set() and any(s.step_index == 2 for s in states):
            self.hold.clear()
            self.entered.set()
            assert self.release.wait(30)
        super().step_batch(states)


@contextlib.contextmanager
def counting_calls(module: torch.nn.Module) -> Iterator[list[int]]:
    """A list that grows by one per forward call of ``module`` inside the block."""
    calls: list[int] = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


JOINERS = [
    (5, SamplingParams(num_inference_steps=3, seed=8, guidance_scale=3.0)),
    (
        "goldfish",
        SamplingParams(num_inference_steps=6, seed=9, guidance_scale=3.0, num_outputs_per_prompt=2),
    ),
]
FIRST = (2, SamplingParams(num_inference_steps=6, seed=7, guidance_scale=3.0))


async def final_output(engine: DiffusionEngine, rid: str) -> RequestOutput:
    return [out async for out in engine.stream(rid)][-1]


def join_mid_flight(engine: DiffusionEngine, adapter: GatedAdapter) -> list[RequestOutput]:
    """Run FIRST, and add JOINERS while its third step runs."""

    async def scenario() -> list[RequestOutput]:
        adapter.hold.set()
        first = await engine.add_request(*FIRST)
        assert await asyncio.to_thread(adapter.entered.wait, 30)
        ids = [first] + [await engine.add_request(*joiner) for joiner in JOINERS]
        adapter.release.set()
        return [await final_output(engine, rid) for rid in ids]

    return asyncio.run(scenario())


@pytest.mark.parametrize("rows_per_call", [None, 8])
def test_requests_joining_mid_flight_share_each_denoiser_call(
    make_engine: Build, pipes: dict[str, Any], rows_per_call: int | None
) -> None:
    pipe = pipes["dit"]
    adapter = GatedAdapter(pipe, rows_per_call=rows_per_call)
    engine = make_engine(factory_of(adapter), execution_mode="step", warmup=False)
    with counting_calls(pipe.transformer) as calls:
        outs = join_mid_flight(engine, adapter)
    assert all(o.ok for o in outs), [o.error for o in outs]
    first, joiner, long_joiner = (o.request_id for o in outs)
    # Both joiners enter at the boundary after the held step and leave when done; every
    # step, whoever runs in it, is one call of the transformer.
    assert adapter.steps == [
        [(first, 0)],
        [(first, 1)],
        [(first, 2)],
        [(first, 3), (joiner, 0), (long_joiner, 0)],
        [(first, 4), (joiner, 1), (long_joiner, 1)],
        [(first, 5), (joiner, 2), (long_joiner, 2)],
        [(long_joiner, 3)],
        [(long_joiner, 4)],
        [(long_joiner, 5)],
    ]
    assert len(calls) == len(adapter.steps)


@pytest.mark.parametrize("rows_per_call", [None, 8])
def test_a_request_joined_mid_flight_keeps_its_own_output(
    make_engine: Build, pipes: dict[str, Any], rows_per_call: int | None
) -> None:
    """Bit-identical with fixed-size denoiser calls; within rounding with one call for all rows."""
    adapter = GatedAdapter(pipes["dit"], rows_per_call=rows_per_call)
    engine = make_engine(factory_of(adapter), execution_mode="step", warmup=False)
    together = join_mid_flight(engine, adapter)
    for (prompt, params), out in zip([FIRST, *JOINERS], together, strict=True):
        alone = forward_alone(adapter, prompt, params, params.seed or 0)
        assert out.image_batch is not None
        if rows_per_call is None:
            torch.testing.assert_close(out.image_batch, alone, atol=ROUNDING_ATOL, rtol=0)
        else:
            assert torch.equal(out.image_batch, alone)


@pytest.mark.parametrize("family", ["ddpm", "dit", "sd"])
def test_request_mode_batches_requests_without_swapping_their_outputs(
    pipes: dict[str, Any], family: str
) -> None:
    prompt = {"ddpm": None, "dit": 4, "sd": "a b"}[family]
    guidance = 1.0 if family == "ddpm" else 2.0
    params = [
        SamplingParams(num_inference_steps=3, guidance_scale=guidance, num_outputs_per_prompt=n)
        for n in (1, 2, 1)
    ]
    adapter = DiffusersPipeline(pipes[family], rows_per_call=4)
    batch = [request(f"r{i}", prompt, p, 100 + i) for i, p in enumerate(params)]
    together = adapter.forward(batch)
    assert list(together) == ["r0", "r1", "r2"]
    for i, p in enumerate(params):
        assert torch.equal(together[f"r{i}"], forward_alone(adapter, prompt, p, 100 + i))


# -- loading, previews ---------------------------------------------------------------------


def test_a_saved_pipeline_loads_by_name_and_matches_the_object_it_was_saved_from(
    make_engine: Build, pipes: dict[str, Any], tmp_path: Path
) -> None:
    pipes["dit"].save_pretrained(tmp_path)
    engine = make_engine("diffusers", pipeline_kwargs={"path": str(tmp_path)})
    params = SamplingParams(num_inference_steps=3, seed=4, guidance_scale=2.0)
    [out] = engine.generate([1], params)
    expected = reference(
        pipes["dit"], 4, num_inference_steps=3, class_labels=[1], guidance_scale=2.0
    )
    assert out.image_batch is not None and torch.equal(out.image_batch, expected)


def test_streaming_sends_decoded_previews_of_the_clean_image_estimate(
    make_engine: Build, pipes: dict[str, Any]
) -> None:
    adapter = DiffusersPipeline(pipes["sd"])
    engine = make_engine(
        factory_of(adapter), streaming_output=True, preview_interval=2, warmup=False
    )

    async def scenario() -> list[RequestOutput]:
        rid = await engine.add_request("a", SamplingParams(num_inference_steps=4, seed=1))
        return [out async for out in engine.stream(rid)]

    outs = asyncio.run(scenario())
    assert [(o.step, o.image_batch is not None) for o in outs] == [
        (1, False),
        (2, True),
        (3, False),
        (4, True),
    ]
    preview = outs[1].image_batch
    assert preview is not None and preview.shape == (1, 3, 16, 16)
    assert preview.min() >= 0 and preview.max() <= 1


# -- a stateful run over the real engine ---------------------------------------------------


def test_engine_lifecycle_with_the_tiny_dit_in_step_mode(pipes: dict[str, Any]) -> None:
    """Add / abort / read / pause / close on a step-mode engine over the tiny DiT.

    The denoiser runs in fixed-size calls, so the harness's final check holds
    bit for bit: every completed output equals the same request run alone.
    """
    pipe = pipes["dit"]

    def config() -> EngineConfig:
        adapter = DiffusersPipeline(pipe, rows_per_call=8)
        return EngineConfig(
            pipeline=factory_of(adapter),
            device="cpu",
            max_num_seqs=3,
            execution_mode="step",
            warmup=False,
        )

    machine = lifecycle_machine(
        config,
        prompts=st.sampled_from([0, 1, 999, "goldfish"]),
        params=sampling_params(steps=(1, 3), outputs=(1, 2), guidance=[1.0, 3.0]),
    )
    run_state_machine_as_test(
        machine, settings=settings(max_examples=10, stateful_step_count=8, deadline=None)
    )
    assert engine_threads() == []


# -- schedulers with a minimum step count ----------------------------------------------------


def test_a_scheduler_that_needs_four_steps_starts_an_engine_and_refuses_fewer(
    models: Any, pipes: dict[str, Any], make_engine: Callable[..., DiffusionEngine]
) -> None:
    pndm = models.with_scheduler(pipes["sd"], "PNDMScheduler", skip_prk_steps=False)
    adapter = DiffusersPipeline(pndm)
    assert adapter.family.min_inference_steps == 4
    assert adapter.warmup_request()[1].num_inference_steps == 4
    engine = make_engine(factory_of(adapter), execution_mode="step")  # warms up
    with pytest.raises(InvalidFieldError, match="at least 4") as info:
        engine.generate(["a cat"], SamplingParams(num_inference_steps=3, seed=1))
    assert info.value.field == "num_inference_steps"
    [output] = engine.generate(["a cat"], SamplingParams(num_inference_steps=4, seed=1))
    assert output.ok
    assert DiffusersPipeline(pipes["sd"]).family.min_inference_steps == 1
