"""LoRA adapters: validation, run-time management, slots and eviction, mixed batches."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import (
    FAULTY_NAME,
    FailStageOnRankOne,
    adapter,
    digits_layer_shapes,
    write_adapter,
)

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    InvalidFieldError,
    LoRARequest,
    SamplingParams,
)
from diffusion_runtime.core import EngineCore
from diffusion_runtime.errors import LoRAError, PipelineContractError, RPCError
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.lora.weights import AdapterFileError, load_adapter
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.stage import StageClient

STEPS = 3


def params(lora: LoRARequest | None, seed: int = 0, **overrides: Any) -> SamplingParams:
    return SamplingParams(num_inference_steps=STEPS, seed=seed, lora=lora, **overrides)


def digits_config(**overrides: Any) -> EngineConfig:
    overrides.setdefault("device", "cpu")
    overrides.setdefault("warmup", False)
    overrides.setdefault("max_loras", 2)
    return EngineConfig(pipeline="digits", **overrides)


@pytest.fixture
def cores() -> Iterator[Callable[..., EngineCore]]:
    """Build digits engine cores that are shut down at teardown."""
    built: list[EngineCore] = []

    def build(**overrides: Any) -> EngineCore:
        core = EngineCore(digits_config(**overrides))
        built.append(core)
        return core

    yield build
    for core in built:
        core.shutdown()


def run_all(core: EngineCore) -> dict[str, Any]:
    outputs = {}
    while core.has_unfinished():
        for output in core.step().outputs:
            if output.finished:
                outputs[output.request_id] = output
    return outputs


# -- values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("name", "", "non-empty str"),
        ("name", 7, "non-empty str"),
        ("name", "a\0b", "without NUL"),
        ("adapter_id", 0, "integer in [1, 2147483647]"),
        ("adapter_id", 2**31, "integer in [1,"),
        ("adapter_id", True, "integer"),
        ("adapter_id", "3", "integer"),
        ("path", "", "non-empty str"),
        ("path", None, "non-empty str"),
        ("scale", math.nan, "finite number"),
        ("scale", 101.0, "finite number in [-100.0, 100.0]"),
        ("scale", "1", "finite number"),
    ],
)
def test_lora_request_rejects_bad_fields(field: str, value: Any, rule: str) -> None:
    fields: dict[str, Any] = {"name": "style", "adapter_id": 1, "path": "a.safetensors"}
    fields[field] = value
    with pytest.raises(InvalidFieldError) as info:
        LoRARequest(**fields)
    assert info.value.field == field
    assert f"LoRARequest.{field}" in str(info.value) and rule in str(info.value)


def test_sampling_params_carry_a_lora_in_the_request_batch_key_only() -> None:
    with pytest.raises(InvalidFieldError, match=r"SamplingParams\.lora must be a LoRARequest"):
        SamplingParams(lora="style")  # type: ignore[arg-type]
    one = SamplingParams(lora=LoRARequest("a", 1, "a.safetensors"))
    two = SamplingParams(lora=LoRARequest("b", 2, "b.safetensors", scale=0.5))
    base = SamplingParams()
    assert len({one.request_batch_key(), two.request_batch_key(), base.request_batch_key()}) == 3
    assert one.step_batch_key() == two.step_batch_key() == base.step_batch_key()
    assert one.adapter_id == 1 and base.adapter_id is None


def test_engine_config_lora_fields_are_validated() -> None:
    with pytest.raises(InvalidFieldError, match=r"max_cpu_loras must be at least max_loras \(4\)"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(InvalidFieldError, match="max_lora_rank"):
        EngineConfig(max_lora_rank=0)
    assert EngineConfig(max_loras=3).lora_capacity == 3
    assert EngineConfig(max_loras=3, max_cpu_loras=5).lora_capacity == 5


def test_adapter_files_are_checked_against_the_network(tmp_path: Path) -> None:
    shapes = digits_layer_shapes()
    path = write_adapter(tmp_path / "a.safetensors", seed=0, rank=4, layers=["out"], alpha=8.0)
    weights = load_adapter(path, shapes, max_rank=16)
    assert weights.rank == 4 and list(weights.layers) == ["out"]
    with pytest.raises(AdapterFileError, match="one rank in \\[1, 2\\]"):
        load_adapter(path, shapes, max_rank=2)
    with pytest.raises(AdapterFileError, match="no adapted layer 'out'"):
        load_adapter(path, {"inp": shapes["inp"]}, max_rank=16)
    with pytest.raises(AdapterFileError, match="needs A of shape"):
        load_adapter(path, {"out": (3, 3)}, max_rank=16)
    with pytest.raises(AdapterFileError, match="cannot read"):
        load_adapter(tmp_path / "missing.safetensors", shapes, max_rank=16)


# -- admission -------------------------------------------------------------------------


def test_an_unknown_adapter_is_refused_unless_its_file_loads(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores()
    missing = LoRARequest("gone", 5, str(tmp_path / "nowhere.safetensors"))
    with pytest.raises(InvalidFieldError) as info:
        core.validate("3", params(missing))
    assert info.value.field == "lora" and "not loaded and cannot be" in str(info.value)
    lora = adapter(tmp_path, 1)
    core.validate("3", params(lora))
    core.add_request("r", "3", params(lora), seed=0)
    assert run_all(core)["r"].ok
    assert core.list_loras() == [1], "loaded on demand at admission"
    clash = LoRARequest("other", 1, str(tmp_path / "other.safetensors"))
    with pytest.raises(InvalidFieldError, match="is loaded from"):
        core.validate("3", params(clash))


def test_adapters_are_refused_when_lora_is_off(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores(max_loras=0)
    with pytest.raises(InvalidFieldError, match="max_loras > 0"):
        core.validate("3", params(adapter(tmp_path, 1)))
    with pytest.raises(LoRAError, match="adapters are off"):
        core.add_lora(adapter(tmp_path, 1))
    assert core.list_loras() == []


def test_adapters_need_a_pipeline_that_enables_them(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    with pytest.raises(PipelineContractError, match="needs a pipeline with enable_lora"):
        make_engine("testing-noise", max_loras=1)


# -- management, slots and eviction ----------------------------------------------------


def test_add_list_pin_remove_on_the_engine(
    make_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    engine = make_engine("digits", max_loras=2, warmup=False)
    assert engine.add_lora(adapter(tmp_path, 2)) is True
    assert engine.add_lora(adapter(tmp_path, 2)) is False, "already loaded"
    assert engine.add_lora(adapter(tmp_path, 1)) is True
    assert engine.list_loras() == [1, 2]
    assert engine.pin_lora(2) is True and engine.pin_lora(9) is False
    assert engine.remove_lora(1) is True and engine.remove_lora(1) is False
    assert engine.list_loras() == [2]
    with pytest.raises(RPCError, match="reserved"):
        engine.collective_rpc("remove_lora", (2,))


def test_least_recently_used_unpinned_adapter_is_evicted(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores(max_loras=1, max_cpu_loras=2)
    core.add_lora(adapter(tmp_path, 1))
    core.add_lora(adapter(tmp_path, 2))
    core.add_request("uses-1", "1", params(adapter(tmp_path, 1)), seed=0)
    run_all(core)  # adapter 1 is now the most recently used
    core.add_lora(adapter(tmp_path, 3))
    assert core.list_loras() == [1, 3], "2 was the least recently used"
    assert core.pin_lora(1)
    core.add_lora(adapter(tmp_path, 4))
    assert core.list_loras() == [1, 4], "1 is pinned: 3 goes although 1 is older"
    assert core.pin_lora(4)
    with pytest.raises(LoRAError, match="pinned or used by active requests"):
        core.add_lora(adapter(tmp_path, 5))
    assert core.list_loras() == [1, 4]
    assert core.collective_rpc("staged_lora_ids") == [[]]


def test_an_adapter_in_use_is_neither_evicted_nor_removed(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores(execution_mode="step", max_num_seqs=1, max_loras=1, max_cpu_loras=2)
    core.add_request("runs", "1", params(adapter(tmp_path, 1)), seed=0)
    core.add_request("waits", "2", params(adapter(tmp_path, 2)), seed=0)
    core.step()
    assert set(core.scheduler.running) == {"runs"} and core.scheduler.num_waiting == 1
    for adapter_id in (1, 2):  # running, waiting
        with pytest.raises(LoRAError, match=f"adapter {adapter_id} is used by waiting, running"):
            core.remove_lora(adapter_id)
    with pytest.raises(LoRAError, match="no room"):
        core.add_lora(adapter(tmp_path, 3))
    outputs = run_all(core)
    assert outputs["runs"].ok and outputs["waits"].ok
    assert core.remove_lora(1) and core.remove_lora(2)
    assert core.list_loras() == []


def test_a_preempted_request_keeps_its_adapter(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores(
        execution_mode="step", scheduling_policy="priority", max_num_seqs=1, max_cpu_loras=2
    )
    core.add_request("low", "3", params(adapter(tmp_path, 1), priority=5), seed=0)
    core.step()
    core.add_request("high", "5", params(adapter(tmp_path, 2), priority=-5), seed=0)
    core.step()
    assert core.scheduler.requests["low"].state is RequestStatus.PREEMPTED
    with pytest.raises(LoRAError, match="adapter 1 is used"):
        core.remove_lora(1)
    with pytest.raises(LoRAError, match="no room"):
        core.add_lora(adapter(tmp_path, 3))
    assert all(output.ok for output in run_all(core).values())


def test_a_step_holds_at_most_max_loras_adapters(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores(execution_mode="step", max_num_seqs=8, max_loras=1, max_cpu_loras=3)
    loras = {1: adapter(tmp_path, 1, rank=8), 2: adapter(tmp_path, 2, rank=2)}
    for i, adapter_id in enumerate((1, 1, 2)):
        core.add_request(f"r{i}", "5", params(loras[adapter_id], seed=i), seed=i)
    core.add_request("base", "5", params(None), seed=0)
    core.step()
    assert set(core.scheduler.running) == {"r0", "r1"}, "adapter 2 waits: one slot"
    outputs = run_all(core)
    assert all(output.ok for output in outputs.values()) and len(outputs) == 4
    # Adapter 2 (rank 2) replaced adapter 1 (rank 8) in the one slot: nothing stale is left.
    fresh = cores(execution_mode="step")
    fresh.add_request("alone", "5", params(loras[2], seed=2), seed=2)
    assert torch.equal(run_all(fresh)["alone"].image_batch, outputs["r2"].image_batch)


# -- batching --------------------------------------------------------------------------


def test_mixed_adapter_step_batch_rows_equal_solo_runs(
    make_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    loras = [None, adapter(tmp_path, 1, rank=4), adapter(tmp_path, 2, 0.5, rank=8)]
    loras.append(adapter(tmp_path, 3, -2.0, rank=2))
    engine = make_engine("digits", execution_mode="step", max_loras=3, max_num_seqs=8)
    # Rows with every adapter and none, guided (two network rows per image) and not,
    # one or two images per request.
    batch = [
        params(
            loras[i % 4],
            seed=i,
            guidance_scale=3.0 if i % 3 == 0 else 1.0,
            num_outputs_per_prompt=2 if i in (2, 3) else 1,
        )
        for i in range(8)
    ]
    prompts = [str(i) for i in range(8)]
    mixed = engine.generate(prompts, batch)
    assert engine.list_loras() == [1, 2, 3]
    for prompt, each, together in zip(prompts, batch, mixed, strict=True):
        alone = engine.generate([prompt], [each])[0]
        assert torch.equal(alone.image_batch, together.image_batch), each.lora
    plain = make_engine("digits", execution_mode="step", max_num_seqs=8, warmup=False)
    for i in (0, 4):  # base rows of a mixed batch equal an engine without adapters
        assert torch.equal(
            plain.generate([prompts[i]], [batch[i]])[0].image_batch, mixed[i].image_batch
        )
    differs = mixed[1].image_batch - engine.generate(["1"], [params(None, seed=1)])[0].image_batch
    assert differs.abs().max() > 0.01, "the adapter changes the image"


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_survive_sleep_and_wake_bit_for_bit(
    make_engine: Callable[..., DiffusionEngine], tmp_path: Path, level: int
) -> None:
    """A level-2 wake loads the network again under the same adapter slots."""
    engine = make_engine("digits", execution_mode="step", max_loras=2)
    request = params(adapter(tmp_path, 1, rank=4), seed=5)
    [before] = engine.generate(["4"], [request])
    engine.sleep(level)
    engine.wake_up()
    [after] = engine.generate(["4"], [request])
    assert engine.list_loras() == [1]
    assert before.ok and after.ok, after.error
    assert torch.equal(before.image_batch, after.image_batch)


def test_request_mode_waves_do_not_mix_adapters(
    cores: Callable[..., EngineCore], tmp_path: Path
) -> None:
    core = cores(max_num_seqs=8)
    order = [1, 1, 2, None]
    for i, adapter_id in enumerate(order):
        lora = None if adapter_id is None else adapter(tmp_path, adapter_id)
        core.add_request(f"r{i}", "4", params(lora), seed=i)
    waves = []
    while core.has_unfinished():
        finished = [o.request_id for o in core.step().outputs if o.finished]
        if finished:
            waves.append(sorted(finished))
    assert waves == [["r0", "r1"], ["r2"], ["r3"]]


# -- mp: collective and all-or-nothing -------------------------------------------------


def test_adapters_on_two_mp_workers_are_all_or_nothing(
    make_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    engine = make_engine(
        "digits",
        executor_backend="mp",
        num_workers=2,
        max_loras=2,
        warmup=False,
        worker_extensions=(FailStageOnRankOne,),
        worker_start_timeout_s=120.0,
    )
    lora = adapter(tmp_path, 1)
    assert engine.add_lora(lora) is True
    assert engine.collective_rpc("list_loras") == [[1], [1]]
    broken = LoRARequest(FAULTY_NAME, 2, lora.path)
    with pytest.raises(OSError, match="disk error on rank 1"):
        engine.add_lora(broken)
    assert engine.collective_rpc("list_loras") == [[1], [1]]
    assert engine.collective_rpc("staged_lora_ids") == [[], []], "rank 0 dropped its copy"
    refused = engine.generate(["1"], [params(broken)])[0]  # loaded on demand: fails the same way
    assert not refused.ok and "disk error on rank 1" in (refused.error or "")
    assert engine.collective_rpc("staged_lora_ids") == [[], []]
    assert engine.list_loras() == [1]
    assert engine.pin_lora(1) is True
    image = engine.generate(["7"], [params(lora, seed=3)])[0].image_batch
    with DiffusionEngine.make_engine(digits_config()) as uni:
        assert torch.equal(uni.generate(["7"], [params(lora, seed=3)])[0].image_batch, image)
    assert engine.remove_lora(1) is True
    assert engine.collective_rpc("list_loras") == [[], []]


def test_the_docs_example_runs_and_prints_what_the_page_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    page = (Path(__file__).parent.parent / "docs" / "lora.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "add_lora" in b]
    exec(compile(block, "docs/lora.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["[1]", "True"]


def test_the_stage_manages_adapters_and_carries_them_on_requests(tmp_path: Path) -> None:
    lora = adapter(tmp_path, 1, scale=0.7)
    config = digits_config(execution_mode="step")

    async def scenario() -> list[RequestOutput]:
        # A clean exit, given time to make it on a loaded machine (5 s by default).
        client = StageClient(config, shutdown_grace_s=30.0)
        await client.start()
        try:
            assert await client.add_lora(lora) is True
            assert await client.add_lora(lora) is False
            assert await client.list_loras() == [1]
            assert await client.pin_lora(1) is True and await client.pin_lora(2) is False
            outputs = await client.generate(["2", "2"], [params(lora, seed=1), params(None, 1)])
            with pytest.raises(RPCError, match="allow-list"):
                await client.collective_rpc("commit_lora", [1, []])
            assert await client.remove_lora(1) is True
            assert await client.list_loras() == []
            return outputs
        finally:
            await client.shutdown()
            assert client.exitcode == 0

    outputs = asyncio.run(scenario())
    with DiffusionEngine.make_engine(config) as engine:
        expected = engine.generate(["2", "2"], [params(lora, seed=1), params(None, 1)])
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got.image_batch, want.image_batch)
