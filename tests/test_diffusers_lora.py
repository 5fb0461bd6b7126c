"""LoRA adapters for the diffusers adapter, loaded by diffusers' own LoRA loading (peft).

The adapters are built from config in the test: a peft ``LoraConfig`` on a copy
of the tiny Stable Diffusion UNet, random non-zero weights, saved by
``StableDiffusionPipeline.save_lora_weights``. Every test skips without
diffusers or peft.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import factory_of
from lora_adapters import FAULTY_NAME, FailStageOnRankOne, write_peft_adapter

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    InvalidFieldError,
    LoRARequest,
    SamplingParams,
)
from diffusion_runtime.core import EngineCore
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.stage import StageClient

Build = Callable[..., DiffusionEngine]
PROMPT = "ab"
STEPS = 3
#: Modules of the tiny UNet each adapter targets: attention Linear layers and Conv2d ones.
TARGETS = {
    1: ["to_q", "to_k", "to_v", "to_out.0", "conv1", "proj_in"],
    2: ["to_q", "to_v", "ff.net.2", "conv2"],
}
#: How far a row with an adapter may move with its batch mates (measured: 5.4e-7).
MIXED_BATCH_ATOL = 1e-5


@pytest.fixture(scope="module")
def sd(models: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Any]:
    """Builds the tiny Stable Diffusion pipeline again (same weights every time)."""
    pytest.importorskip("peft")
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    template = models.stable_diffusion_pipeline(tokenizer)
    return lambda: copy.deepcopy(template)


@pytest.fixture(scope="module")
def files(sd: Callable[[], Any], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Adapter files by id: 1 (rank 4, alpha 8) and 2 (rank 2, alpha 2)."""
    directory = tmp_path_factory.mktemp("adapters")
    return {
        1: write_peft_adapter(sd(), directory / "one", TARGETS[1], rank=4, alpha=8, seed=1),
        2: write_peft_adapter(sd(), directory / "two", TARGETS[2], rank=2, alpha=2, seed=2),
    }


def lora(files: dict[int, Path], adapter_id: int, scale: float = 1.0) -> LoRARequest:
    return LoRARequest(f"style-{adapter_id}", adapter_id, str(files[adapter_id]), scale)


def params(lora: LoRARequest | None, seed: int = 0, **overrides: Any) -> SamplingParams:
    overrides.setdefault("guidance_scale", 3.0)
    return SamplingParams(num_inference_steps=STEPS, seed=seed, lora=lora, **overrides)


def engine_of(make_engine: Build, pipe: Any, **overrides: Any) -> DiffusionEngine:
    overrides.setdefault("max_loras", 2)
    overrides.setdefault("execution_mode", "step")
    rows_per_call = overrides.pop("rows_per_call", None)
    adapter = DiffusersPipeline(pipe, rows_per_call=rows_per_call)
    return make_engine(factory_of(adapter), warmup=False, **overrides)


def images(engine: DiffusionEngine, batch: Sequence[SamplingParams]) -> list[torch.Tensor]:
    outputs = engine.generate([PROMPT] * len(batch), list(batch))
    for output in outputs:
        assert output.ok, output.error
    return [output.image_batch for output in outputs]


def diffusers_with(pipe: Any, path: Path | None, scale: float, seed: int) -> torch.Tensor:
    """``pipe(...)`` itself, with the adapter loaded by ``load_lora_weights`` at ``scale``."""
    if path is not None:
        pipe.load_lora_weights(str(path), adapter_name="style")
        pipe.set_adapters(["style"], [scale])
    generator = torch.Generator().manual_seed(seed)
    result: torch.Tensor = pipe(
        PROMPT,
        num_inference_steps=STEPS,
        guidance_scale=3.0,
        generator=generator,
        output_type="pt",
    ).images
    return result


# -- one adapter: equal to diffusers -------------------------------------------------------


@pytest.mark.parametrize(("mode", "scale"), [("step", 1.0), ("step", 0.5), ("request", 1.0)])
def test_one_adapter_equals_diffusers_with_it_loaded_bit_for_bit(
    make_engine: Build, sd: Callable[[], Any], files: dict[int, Path], mode: str, scale: float
) -> None:
    expected = diffusers_with(sd(), files[1], scale, seed=7)
    assert (expected - diffusers_with(sd(), None, 1.0, seed=7)).abs().max() > 0.01
    engine = engine_of(make_engine, sd(), execution_mode=mode)
    [got] = images(engine, [params(lora(files, 1, scale), seed=7)])
    assert torch.equal(got, expected)


# -- mixed adapters in one step batch ------------------------------------------------------


def test_mixed_adapter_rows_stay_within_rounding_of_each_request_alone(
    make_engine: Build, sd: Callable[[], Any], files: dict[int, Path]
) -> None:
    """Adapters (peft's mixed batch) and scales (a second pass) mixed in one step.

    With fixed-size denoiser calls a row without an adapter is bit-identical to the
    base model; a row with one moves by rounding only: peft gathers each adapter's
    rows into a sub-batch whose size depends on the batch mates (``docs/lora.md``).
    """
    loras = [None, lora(files, 1), lora(files, 2), lora(files, 1, 0.5)]
    batch = [params(loras[i % 4], seed=i, guidance_scale=3.0 if i % 3 else 1.0) for i in range(6)]
    engine = engine_of(make_engine, sd(), rows_per_call=4, max_num_seqs=8)
    mixed = images(engine, batch)
    for each, together in zip(batch, mixed, strict=True):
        [alone] = images(engine, [each])
        assert (alone - together).abs().max() <= MIXED_BATCH_ATOL, each.lora
    plain = engine_of(make_engine, sd(), rows_per_call=4, max_loras=0)
    for i in (0, 4):  # rows without an adapter: the base model, as without adapters
        assert torch.equal(images(plain, [batch[i]])[0], mixed[i])
    base_of_row_1 = images(plain, [params(None, seed=1)])[0]
    assert (mixed[1] - base_of_row_1).abs().max() > 0.01, "the adapter changes the image"


# -- loading, refusal, slots ---------------------------------------------------------------


def test_files_the_pipeline_cannot_load_are_refused_by_field(
    make_engine: Build, sd: Callable[[], Any], files: dict[int, Path], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    wrong_module = tmp_path / "wrong.safetensors"
    save_file({"unet.nowhere.to_q.lora_A.weight": torch.ones(2, 8)}, str(wrong_module))
    text_encoder = tmp_path / "text.safetensors"
    save_file({"text_encoder.x.lora_A.weight": torch.ones(2, 8)}, str(text_encoder))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    engine = engine_of(make_engine, sd(), max_lora_rank=2)
    cases = {
        wrong_module: "has no module 'nowhere.to_q'",
        text_encoder: "not a UNet LoRA weight",
        garbage: "cannot read a safetensors file",
        files[1]: r"rank\s+in \[1, 2\]",  # rank 4 over max_lora_rank
    }
    for adapter_id, (path, reason) in enumerate(cases.items(), start=5):
        request = LoRARequest("bad", adapter_id, str(path))
        with pytest.raises(InvalidFieldError, match=reason) as refused:
            engine.generate([PROMPT], [params(request)])
        assert refused.value.field == "lora"
        with pytest.raises(InvalidFieldError, match=reason) as refused:
            engine.add_lora(request)
        assert (refused.value.owner, refused.value.field) == ("LoRARequest", "path")
    assert engine.list_loras() == []
    assert engine.add_lora(lora(files, 2)) is True  # still serving
    assert images(engine, [params(lora(files, 2))])[0] is not None


def test_eviction_pinning_and_removal_unload_the_peft_adapters(
    sd: Callable[[], Any], files: dict[int, Path]
) -> None:
    adapter = DiffusersPipeline(sd())
    core = EngineCore(
        EngineConfig(pipeline=factory_of(adapter), max_loras=1, max_cpu_loras=2, warmup=False)
    )
    try:
        assert core.add_lora(lora(files, 1)) and core.add_lora(lora(files, 2))
        assert core.pin_lora(1)
        assert core.add_lora(LoRARequest("three", 3, str(files[1])))  # evicts 2, not pinned 1
        assert core.list_loras() == [1, 3]
        assert sorted(adapter.family.pipe.unet.peft_config) == ["adapter-1", "adapter-3"]
        assert core.remove_lora(3) and core.remove_lora(1)
        assert list(getattr(adapter.family.pipe.unet, "peft_config", {})) == []
    finally:
        core.shutdown()


def test_request_mode_waves_do_not_mix_adapters(
    sd: Callable[[], Any], files: dict[int, Path]
) -> None:
    adapter = DiffusersPipeline(sd())
    core = EngineCore(
        EngineConfig(pipeline=factory_of(adapter), max_loras=2, max_num_seqs=8, warmup=False)
    )
    try:
        for i, adapter_id in enumerate([1, 1, 2, None]):
            request = None if adapter_id is None else lora(files, adapter_id)
            core.add_request(f"r{i}", PROMPT, params(request), seed=i)
        waves = []
        while core.has_unfinished():
            finished = [o.request_id for o in core.step().outputs if o.finished]
            if finished:
                waves.append(sorted(finished))
        assert waves == [["r0", "r1"], ["r2"], ["r3"]]
    finally:
        core.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_survive_sleep_and_wake_bit_for_bit(
    make_engine: Build, sd: Callable[[], Any], files: dict[int, Path], level: int
) -> None:
    """A level-2 wake builds the pipeline again and loads the adapters into it again."""
    adapter = DiffusersPipeline(sd(), source=sd)
    engine = make_engine(factory_of(adapter), execution_mode="step", max_loras=2, warmup=False)
    request = params(lora(files, 2), seed=3)
    [before] = images(engine, [request])
    engine.sleep(level)
    engine.wake_up()
    [after] = images(engine, [request])
    assert torch.equal(before, after)


def test_adapters_on_two_mp_workers_are_all_or_nothing(
    make_engine: Build, sd: Callable[[], Any], files: dict[int, Path], tmp_path: Path
) -> None:
    sd().save_pretrained(tmp_path)
    engine = make_engine(
        "diffusers",
        pipeline_kwargs={"path": str(tmp_path)},
        executor_backend="mp",
        num_workers=2,
        max_loras=2,
        execution_mode="step",
        warmup=False,
        worker_extensions=(FailStageOnRankOne,),
        worker_start_timeout_s=120.0,
        intra_op_threads=1,  # GEMM results depend on the thread count: the same as `uni`
    )
    assert engine.add_lora(lora(files, 1)) is True
    broken = LoRARequest(FAULTY_NAME, 2, str(files[2]))
    with pytest.raises(OSError, match="disk error on rank 1"):
        engine.add_lora(broken)
    assert engine.collective_rpc("list_loras") == [[1], [1]]
    assert engine.collective_rpc("staged_lora_ids") == [[], []], "rank 0 dropped its copy"
    request = params(lora(files, 1), seed=7)
    [image] = images(engine, [request])
    uni = make_engine(
        "diffusers", pipeline_kwargs={"path": str(tmp_path)}, max_loras=2, intra_op_threads=1
    )
    assert torch.equal(images(uni, [request])[0], image)


def test_the_runtime_imports_and_refuses_adapters_clearly_without_peft() -> None:
    script = (
        "import sys\n"
        "sys.modules['peft'] = None\n"  # as if peft were not installed
        "import diffusion_runtime.pipelines.diffusers as d\n"
        "from diffusion_runtime.pipelines.diffusers.peft_adapters import PeftAdapters\n"
        "try:\n"
        "    PeftAdapters(lambda: None, 4)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert "PipelineContractError" in result.stdout and "peft" in result.stdout


def test_the_docs_example_runs_and_prints_what_the_page_says(
    sd: Callable[[], Any], tmp_path: Path
) -> None:
    from test_docs_examples import DOCS, run_block

    sd().save_pretrained(tmp_path / "my-sd")
    printed = run_block(tmp_path, DOCS / "lora.md", '"my-style"')
    assert printed.splitlines()[-1] == "[True, True, True] [1]"


def test_the_stage_loads_diffusers_adapters_and_serves_them_as_in_process(
    sd: Callable[[], Any], files: dict[int, Path], tmp_path: Path
) -> None:
    """Adapters cross the stage's socket by path and load in its worker through peft;
    what it returns is what the same engine gives in process, bit for bit.

    One row per step (``max_num_seqs=1``): the stage admits these three one
    message each, so which steps they share would depend on when each message
    lands, and a Stable Diffusion row is only within rounding of itself in
    another batch (CI once saw the first request differ that way).
    """
    sd().save_pretrained(tmp_path)
    config = EngineConfig(
        pipeline="diffusers",
        pipeline_kwargs={"path": str(tmp_path)},
        device="cpu",
        max_loras=2,
        max_num_seqs=1,
        execution_mode="step",
        warmup=False,
        intra_op_threads=1,
    )
    requests = [params(lora(files, 1), seed=3), params(None, seed=3), params(lora(files, 2), 4)]

    async def scenario() -> list[RequestOutput]:
        # A clean exit, given time to make it on a loaded machine (5 s by default).
        client = StageClient(config, shutdown_grace_s=30.0)
        await client.start()
        try:
            assert await client.add_lora(lora(files, 1)) is True
            assert await client.list_loras() == [1]
            outputs = await client.generate([PROMPT] * 3, requests)  # loads adapter 2 itself
            assert sorted(await client.list_loras()) == [1, 2]
            assert await client.remove_lora(1) is True
            return outputs
        finally:
            await client.shutdown()
            assert client.exitcode == 0

    staged = asyncio.run(scenario())
    with DiffusionEngine.make_engine(config) as engine:
        expected = images(engine, requests)
    for got, want in zip(staged, expected, strict=True):
        assert got.ok, got.error
        assert torch.equal(got.image_batch, want)
