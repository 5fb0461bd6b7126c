"""CFG-parallel diffusers pipelines over real worker processes, bit-identical to one rank.

The tiny DiT and Stable Diffusion are saved with ``save_pretrained`` and loaded
by each worker (``pipeline="diffusers"``) with ``rows_per_call``, which makes a
row's output independent of its batch mates: splitting rows between two mp
ranks must not change a bit, in request mode and step mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from executor_helpers import drain
from lora_adapters import write_peft_adapter
from test_cfg_parallel import core_pair, run_both

from diffusion_runtime import EngineConfig, LoRARequest, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.diffusers import DiffusersPipeline
from diffusion_runtime.runner.parallel import check_parallel_degrees

DIT_NULL_CLASS = 1000


class ClassLabelProbe:
    """A worker extension: the class labels this rank's DiT transformer has seen."""

    def __init__(self, worker: Any) -> None:
        self.labels: set[int] = set()
        transformer = worker.pipeline.family.pipe.transformer
        transformer.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.labels.update(kwargs["class_labels"].tolist())

    def take_labels(self) -> list[int]:
        seen, self.labels = sorted(self.labels), set()
        return seen


@pytest.fixture(scope="module")
def saved(models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny pipelines saved where the workers load them, and a LoRA adapter of SD's."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("cfg-diffusers")
    paths = {"dit": root / "dit", "sd": root / "sd"}
    models.dit_pipeline().save_pretrained(paths["dit"])
    (root / "tokenizer").mkdir()
    sd = models.stable_diffusion_pipeline(root / "tokenizer")
    sd.save_pretrained(paths["sd"])
    targets = ["to_q", "to_v", "conv1"]
    paths["adapter"] = write_peft_adapter(sd, root / "adapter", targets, rank=2, alpha=4, seed=1)
    return {name: str(path) for name, path in paths.items()}


def diffusers_pair(path: str, **config: Any) -> Iterator[tuple[EngineCore, EngineCore]]:
    yield from core_pair(
        **{
            "pipeline": "diffusers",
            "pipeline_kwargs": {"path": path, "rows_per_call": 2},
            "intra_op_threads": 1,
            "worker_extensions": (),
            **config,
        }
    )


@pytest.fixture(scope="module")
def dit_request(saved: dict[str, str]) -> Iterator[tuple[EngineCore, EngineCore]]:
    yield from diffusers_pair(
        saved["dit"], execution_mode="request", max_num_seqs=4,
        worker_extensions=(ClassLabelProbe,),
    )  # fmt: skip


@pytest.fixture(scope="module")
def dit_step(saved: dict[str, str]) -> Iterator[tuple[EngineCore, EngineCore]]:
    yield from diffusers_pair(
        saved["dit"], execution_mode="step", max_num_seqs=3, scheduling_policy="priority",
        preempted_offload_bytes=64 * 2**10,  # preempted states resume from host memory
    )  # fmt: skip


@pytest.fixture(scope="module")
def sd_step(saved: dict[str, str]) -> Iterator[tuple[EngineCore, EngineCore]]:
    yield from diffusers_pair(saved["sd"], execution_mode="step", max_num_seqs=3, max_loras=1)


GUIDED = SamplingParams(num_inference_steps=3, guidance_scale=3.0)
GUIDED_PAIR = SamplingParams(num_inference_steps=2, guidance_scale=1.5, num_outputs_per_prompt=2)
PLAIN = SamplingParams(num_inference_steps=3)
MIXES = {
    "guided": [GUIDED, GUIDED_PAIR],
    "mixed": [GUIDED, PLAIN, GUIDED_PAIR, SamplingParams(num_inference_steps=2)],
}


def submit(params: list[SamplingParams], prompts: list[Any]) -> Any:
    def script(core: EngineCore) -> dict[str, RequestOutput]:
        for i, p in enumerate(params):
            core.add_request(f"r{i}", prompts[i % len(prompts)], p, seed=100 + i)
        return drain(core)

    return script


# Each engine pair's set-up (two worker processes loading the pipeline) costs far
# more than its scripts, and pytest-xdist would build a pair in every worker that
# runs one of its tests: so each pair's proofs run in one test, one after another.


def test_dit_request_mode_is_bit_identical_to_one_rank_and_each_rank_computes_one_branch(
    dit_request: tuple[EngineCore, EngineCore],
) -> None:
    for mix in sorted(MIXES):
        finals = run_both(dit_request, submit(MIXES[mix], [0, 1]))
        assert all(out.ok for out in finals.values()), mix

    # Each rank computes one guidance branch.
    parallel, _ = dit_request
    parallel.collective_rpc("take_labels")
    run_both(dit_request, submit(MIXES["guided"], [0, 1]))
    cond, uncond = parallel.collective_rpc("take_labels")
    assert (cond, uncond) == ([0, 1], [DIT_NULL_CLASS])


#: Step caches decided per request (docs/caching.md): every rank runs every row of a
#: step in which a request caches, and makes the same decisions.
#: (Both backends skip a third to a half of 12 steps at this threshold, docs/caching.md.)
CACHE = {"rel_l1_thresh": 0.3, "warmup_steps": 1}
CACHED = [
    SamplingParams(
        num_inference_steps=12, guidance_scale=3.0, cache={**CACHE, "backend": "tea_cache"}
    ),
    SamplingParams(num_inference_steps=12, cache={**CACHE, "backend": "first_block"}),
    GUIDED_PAIR,
]


def test_dit_step_mode_with_step_caches_and_preemption_is_bit_identical_to_one_rank(
    dit_step: tuple[EngineCore, EngineCore],
) -> None:
    for mix in sorted(MIXES):
        finals = run_both(dit_step, submit(MIXES[mix], [0, 1]))
        assert all(out.ok for out in finals.values()), mix

    # Step caches under cfg-parallel.
    finals = run_both(dit_step, submit(CACHED, [0, 1]))
    assert all(out.ok for out in finals.values())
    assert sum(out.metrics.cached_steps for out in finals.values()) > 0

    # Preempted requests resume from host memory.
    low = SamplingParams(num_inference_steps=6, priority=5, guidance_scale=2.0)

    def script(core: EngineCore) -> dict[str, RequestOutput]:
        before = core.scheduler.num_preemptions
        core.add_request("low-guided", 0, low, seed=7)
        core.add_request("low-plain", 1, SamplingParams(num_inference_steps=6, priority=5), 8)
        core.add_request("low-pair", 1, attrs.evolve(low, num_outputs_per_prompt=2), 9)
        finals = {o.request_id: o for _ in range(2) for o in core.step().outputs if o.finished}
        core.add_request("high", 0, SamplingParams(num_inference_steps=2, guidance_scale=4.0), 1)
        core.add_request("high-2", 1, SamplingParams(num_inference_steps=2), 2)
        core.step()
        assert core.scheduler.num_preemptions > before
        assert core.snapshot().runner_offloaded_ids, "a preempted state waits in host memory"
        return {**finals, **drain(core)}

    finals = run_both(dit_step, script)
    assert all(out.ok for out in finals.values())


def test_stable_diffusion_step_mode_with_an_adapter_is_bit_identical_to_one_rank(
    sd_step: tuple[EngineCore, EngineCore], saved: dict[str, str]
) -> None:
    style = LoRARequest("style", 1, saved["adapter"])
    mixed = [attrs.evolve(GUIDED, lora=style), PLAIN, GUIDED_PAIR, attrs.evolve(PLAIN, lora=style)]
    prompts = ["a cat", {"prompt": "b", "negative_prompt": "c"}]
    finals = run_both(sd_step, submit(mixed, prompts))
    assert all(out.ok for out in finals.values())


def test_only_the_families_with_guidance_take_cfg_parallel(models: Any) -> None:
    config = EngineConfig(device="cpu", cfg_parallel_size=2)
    check_parallel_degrees(DiffusersPipeline(models.dit_pipeline()), config)
    with pytest.raises(InvalidFieldError, match="cfg_parallel_size must be 1 for Diffusers"):
        check_parallel_degrees(DiffusersPipeline(models.ddpm_pipeline()), config)
