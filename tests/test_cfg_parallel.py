"""CFG-parallel digits over real worker processes: every image bit-identical to one rank.

Each module-scoped core pair runs the same script of requests and steps: one
core with ``cfg_parallel_size=2`` (two mp ranks in a gloo group), one
reference with every degree at 1 (and the stage test runs a stage over
two ranks). The digits model computes each row in fixed-size chunks, so
splitting rows between ranks must not change a bit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from executor_helpers import drain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusion_runtime import EngineConfig, LoRARequest, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.digits import LORA_ADAPTERS
from diffusion_runtime.stage import StageClient

#: One xdist worker runs the whole module, so its module fixtures are built once.
pytestmark = pytest.mark.xdist_group("cfg-parallel")

Script = Callable[[EngineCore], dict[str, RequestOutput]]
NULL_CLASS = 10  # the digits model's unconditional label


class LabelProbe:
    """A worker extension: the class labels this rank's network has seen."""

    def __init__(self, worker: Any) -> None:
        self.labels: set[int] = set()
        worker.pipeline.model.register_forward_pre_hook(self._seen)

    def _seen(self, module: Any, args: tuple[torch.Tensor, ...]) -> None:
        self.labels.update(args[2].tolist())

    def take_labels(self) -> list[int]:
        seen, self.labels = sorted(self.labels), set()
        return seen


def core_pair(**config: Any) -> Iterator[tuple[EngineCore, EngineCore]]:
    """A CFG-parallel core and its degree-1 reference, with the auditor raising."""
    config = {
        "pipeline": "digits",
        "device": "cpu",
        "warmup": False,
        "audit": "raise",
        "worker_extensions": (LabelProbe,),
        **config,
    }
    reference = EngineCore(EngineConfig(**config))
    try:
        parallel = EngineCore(
            EngineConfig(cfg_parallel_size=2, worker_start_timeout_s=120.0, **config)
        )
    except BaseException:
        reference.shutdown()
        raise
    try:
        yield parallel, reference
    finally:
        parallel.shutdown()
        reference.shutdown()


@pytest.fixture(scope="module")
def request_cores() -> Iterator[tuple[EngineCore, EngineCore]]:
    yield from core_pair(execution_mode="request", max_num_seqs=8)


@pytest.fixture(scope="module")
def step_cores() -> Iterator[tuple[EngineCore, EngineCore]]:
    yield from core_pair(
        execution_mode="step",
        max_num_seqs=3,
        scheduling_policy="priority",
        preempted_offload_bytes=16 * 2**10,  # preempted states resume from host memory
        max_loras=2,
    )


def run_both(cores: tuple[EngineCore, EngineCore], script: Script) -> dict[str, RequestOutput]:
    """Run ``script`` on both cores; assert every final output is bit-identical."""
    parallel, reference = cores
    got, expected = script(parallel), script(reference)
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        have = got[rid]
        assert (have.status, have.error) == (want.status, want.error), rid
        assert have.image_batch is not None and want.image_batch is not None, rid
        assert torch.equal(have.image_batch, want.image_batch), rid
    for core in cores:
        assert core.auditor is not None and core.auditor.violations == []
    return got


GUIDED = SamplingParams(num_inference_steps=5, guidance_scale=3.0)
GUIDED_PAIR = SamplingParams(num_inference_steps=3, guidance_scale=1.5, num_outputs_per_prompt=2)
PLAIN = SamplingParams(num_inference_steps=4, num_outputs_per_prompt=2)
NOISY = SamplingParams(num_inference_steps=4, extra_args={"eta": 0.5})
BOLD = LoRARequest("bold", 1, str(LORA_ADAPTERS["bold"]))
INVERTED = LoRARequest("inverted", 2, str(LORA_ADAPTERS["inverted"]))
ADAPTED = [
    attrs.evolve(GUIDED, lora=BOLD),
    attrs.evolve(PLAIN, lora=INVERTED),
    GUIDED_PAIR,
    attrs.evolve(GUIDED_PAIR, lora=INVERTED),
]
#: Step caches decided per request (docs/caching.md): every rank steps the same
#: latents, so every rank makes the same decisions and gathers the same rows.
TEA = {"backend": "tea_cache", "rel_l1_thresh": 0.3}
CACHED = [
    SamplingParams(num_inference_steps=8, guidance_scale=3.0, cache=TEA),
    SamplingParams(num_inference_steps=6, num_outputs_per_prompt=2, cache=TEA),
    GUIDED_PAIR,
    SamplingParams(num_inference_steps=7, guidance_scale=1.5, cache={**TEA, "warmup_steps": 3}),
]
MIXES = {
    "cached": CACHED,
    "guided": [GUIDED, GUIDED_PAIR],
    "unguided": [PLAIN, NOISY, PLAIN],
    "mixed": [GUIDED, PLAIN, GUIDED_PAIR, NOISY, SamplingParams(num_inference_steps=2)],
}


def submit_all(params: list[SamplingParams]) -> Script:
    def script(core: EngineCore) -> dict[str, RequestOutput]:
        for i, p in enumerate(params):
            core.add_request(f"r{i}", str(i % 10), p, seed=100 + i)
        return drain(core)

    return script


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_request_mode_images_are_bit_identical_to_one_rank(
    request_cores: tuple[EngineCore, EngineCore], mix: str
) -> None:
    finals = run_both(request_cores, submit_all(MIXES[mix]))
    assert all(out.ok for out in finals.values())
    if mix == "cached":
        assert sum(out.metrics.cached_steps for out in finals.values()) > 0


def test_each_rank_computes_one_guidance_branch(
    request_cores: tuple[EngineCore, EngineCore],
) -> None:
    parallel, _ = request_cores
    parallel.collective_rpc("take_labels")
    run_both(request_cores, submit_all(MIXES["guided"]))
    cond, uncond = parallel.collective_rpc("take_labels")
    assert uncond == [NULL_CLASS]  # rank 1: only the unconditional rows
    assert {0, 1} <= set(cond)  # rank 0: the prompts' digits (and null-class padding)


@pytest.mark.parametrize("mix", [*sorted(MIXES), "adapters"])
def test_step_mode_images_are_bit_identical_to_one_rank(
    step_cores: tuple[EngineCore, EngineCore], mix: str
) -> None:
    finals = run_both(step_cores, submit_all(ADAPTED if mix == "adapters" else MIXES[mix]))
    assert all(out.ok for out in finals.values())
    if mix == "cached":
        assert sum(out.metrics.cached_steps for out in finals.values()) > 0


def test_preempted_and_resumed_requests_are_bit_identical_to_one_rank(
    step_cores: tuple[EngineCore, EngineCore],
) -> None:
    low = SamplingParams(num_inference_steps=8, priority=5, guidance_scale=2.0)
    low_plain = SamplingParams(num_inference_steps=8, priority=5, num_outputs_per_prompt=2)

    def script(core: EngineCore) -> dict[str, RequestOutput]:
        before = core.scheduler.num_preemptions
        core.add_request("low-guided", "3", low, seed=7)
        core.add_request("low-plain", "4", low_plain, seed=8)
        core.add_request("low-mixed", "5", SamplingParams(num_inference_steps=8, priority=5), 9)
        finals = {o.request_id: o for _ in range(3) for o in core.step().outputs if o.finished}
        core.add_request("high", "6", SamplingParams(num_inference_steps=3, guidance_scale=4.0), 1)
        core.add_request("high-2", "7", SamplingParams(num_inference_steps=3), 2)
        core.step()
        assert core.scheduler.num_preemptions > before
        assert core.scheduler.requests["low-guided"].state is RequestStatus.PREEMPTED
        assert core.snapshot().runner_offloaded_ids, "a preempted state waits in host memory"
        return {**finals, **drain(core)}

    finals = run_both(step_cores, script)
    assert all(out.ok for out in finals.values())


request_params = st.builds(
    SamplingParams,
    num_inference_steps=st.integers(1, 4),
    guidance_scale=st.sampled_from([1.0, 2.5]),
    num_outputs_per_prompt=st.integers(1, 2),
    extra_args=st.sampled_from([{}, {"eta": 1.0}]),
)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=st.lists(request_params, min_size=1, max_size=5))
def test_any_step_mode_workload_is_bit_identical_to_one_rank(
    step_cores: tuple[EngineCore, EngineCore], workload: list[SamplingParams]
) -> None:
    run_both(step_cores, submit_all(workload))


def test_the_stage_serves_cfg_parallel_images_bit_identical_to_one_rank(
    request_cores: tuple[EngineCore, EngineCore],
) -> None:
    """A stage process whose engine runs two ranks that split guidance."""
    _, reference = request_cores
    params = [attrs.evolve(p, seed=200 + i) for i, p in enumerate(MIXES["mixed"])]
    prompts = [str(i) for i in range(len(params))]
    config = EngineConfig(
        pipeline="digits", device="cpu", cfg_parallel_size=2, warmup=False,
        worker_start_timeout_s=120.0,
    )  # fmt: skip

    async def on_the_stage() -> list[RequestOutput]:
        async with StageClient(config) as client:
            return await client.generate(prompts, params)

    outputs = asyncio.run(on_the_stage())
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outputs, strict=True)):
        reference.add_request(f"stage-{i}", prompt, p, seed=200 + i)
        want = drain(reference)[f"stage-{i}"]
        assert out.ok and torch.equal(out.image_batch, want.image_batch)
