"""Host offload of preempted requests' step state (``EngineConfig.preempted_offload_bytes``),
through the real engine core and the digits pipeline with the auditor attached: offloaded
states resume bit-identical, the budget bounds what is offloaded, and nothing is left
behind when an offloaded request ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from executor_helpers import drain

from diffusion_runtime import EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.pipelines.registry import build_pipeline
from diffusion_runtime.runner.state_offload import StateOffloader, map_state_tensors
from diffusion_runtime.runner.worker import Worker

S = RequestStatus
LOW = SamplingParams(
    num_inference_steps=10, priority=5, num_outputs_per_prompt=2, guidance_scale=2.0
)
HIGH = SamplingParams(num_inference_steps=3)
LARGE_BUDGET = 2**30


class OffloadProbe:
    """A worker extension that reports what the runner keeps in host memory."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def offloaded_bytes(self) -> int | None:
        offloader = self.worker.runner.offloader
        return None if offloader is None else offloader.offloaded_bytes

    def state_devices(self, request_id: str) -> list[tuple[str, bool]]:
        """``(device type, pinned)`` of the request's latents and conditioning."""
        state = self.worker.runner.states[request_id]
        tensors = (state.latents, state.conditioning)
        return [(t.device.type, t.device.type == "cpu" and t.is_pinned()) for t in tensors]


@contextlib.contextmanager
def open_core(budget: int, device: str = "cpu", **config: Any) -> Iterator[EngineCore]:
    config.setdefault("max_num_seqs", 1)
    core = EngineCore(
        EngineConfig(
            pipeline="digits",
            device=device,
            execution_mode="step",
            scheduling_policy="priority",
            warmup=False,
            audit="raise",
            preempted_offload_bytes=budget,
            worker_extensions=[OffloadProbe],
            **config,
        )
    )
    try:
        yield core
    finally:
        core.shutdown()
    assert core.auditor is not None and core.auditor.violations == []


def offloaded_bytes(core: EngineCore) -> int | None:
    result: int | None = core.collective_rpc("offloaded_bytes", unique_reply_rank=0)
    return result


def preempt_lows(core: EngineCore, count: int) -> list[str]:
    """Run ``count`` low-priority requests for a few steps, then admit as many
    high-priority ones, which preempt them all."""
    lows = [f"low{i}" for i in range(count)]
    for index, rid in enumerate(lows):
        core.add_request(rid, str(index), LOW, seed=index)
    for _ in range(3):
        core.step()
    for index in range(count):
        core.add_request(f"high{index}", "9", HIGH, seed=100 + index)
    core.step()
    assert all(core.scheduler.requests[rid].state is S.PREEMPTED for rid in lows)
    return lows


def resume(core: EngineCore, request_id: str) -> None:
    """Step until the preempted request has run again."""
    while core.scheduler.requests[request_id].state is not S.RUNNING:
        core.step()


SoloImages = Callable[[str, int, str], torch.Tensor]


@pytest.fixture(scope="module")
def solo_images() -> SoloImages:
    """A low request's images when it runs alone, uninterrupted, without offload."""
    cache: dict[tuple[str, int, str], torch.Tensor] = {}

    def run_alone(prompt: str, seed: int, device: str = "cpu") -> torch.Tensor:
        key = (prompt, seed, device)
        if key not in cache:
            with open_core(budget=0, device=device) as core:
                core.add_request("solo", prompt, LOW, seed)
                images = drain(core)["solo"].image_batch
            assert images is not None
            cache[key] = images
        return cache[key]

    return run_alone


def test_an_offloaded_preempted_request_resumes_bit_identical(solo_images: SoloImages) -> None:
    with open_core(LARGE_BUDGET) as core:
        (low,) = preempt_lows(core, 1)
        snapshot = core.snapshot()
        assert snapshot.runner_offloaded_ids == {low} <= snapshot.runner_cached_ids
        assert (offloaded_bytes(core) or 0) > 0
        resume(core, low)
        snapshot = core.snapshot()
        assert low in snapshot.running_ids and not snapshot.runner_offloaded_ids
        assert offloaded_bytes(core) == 0
        finals = drain(core)
    assert finals[low].ok and finals[low].step == LOW.num_inference_steps
    assert torch.equal(finals[low].image_batch, solo_images("0", 0, "cpu"))


@pytest.mark.parametrize(("budget_in_states", "expected"), [(0.9, 0), (2.5, 2), (10, 3)])
def test_the_budget_bounds_how_many_states_are_offloaded(
    solo_images: SoloImages, budget_in_states: float, expected: int
) -> None:
    with open_core(LARGE_BUDGET) as core:
        preempt_lows(core, 1)
        one_state = offloaded_bytes(core)
    assert one_state
    budget = int(budget_in_states * one_state)
    with open_core(budget, max_num_seqs=3) as core:
        lows = preempt_lows(core, 3)
        snapshot = core.snapshot()
        used = offloaded_bytes(core)
        finals = drain(core)
    assert len(snapshot.runner_offloaded_ids) == expected
    assert snapshot.runner_offloaded_ids <= set(lows)
    assert used == expected * one_state <= budget
    for index, rid in enumerate(lows):
        assert torch.equal(finals[rid].image_batch, solo_images(str(index), index, "cpu"))


@pytest.mark.parametrize("end", ["abort", "shutdown"])
def test_an_offloaded_request_that_ends_leaves_nothing(end: str) -> None:
    with open_core(LARGE_BUDGET) as core:
        (low,) = preempt_lows(core, 1)
        assert core.snapshot().runner_offloaded_ids == {low}
        if end == "abort":
            core.abort([low])
            finals = drain(core)
            snapshot = core.snapshot()
            assert not (snapshot.runner_cached_ids | snapshot.runner_offloaded_ids)
            assert offloaded_bytes(core) == 0
        else:
            finals = {o.request_id: o for o in core.shutdown()}
    assert finals[low].status is S.FINISHED_ABORTED
    assert core.auditor is not None and core.auditor.complete


def test_a_zero_budget_keeps_every_state_in_place(solo_images: SoloImages) -> None:
    with open_core(0) as core:
        (low,) = preempt_lows(core, 1)
        assert core.snapshot().runner_offloaded_ids == frozenset()
        assert offloaded_bytes(core) is None, "no offloader is built"
        assert core.collective_rpc("state_devices", (low,), unique_reply_rank=0) == [
            ("cpu", False),
            ("cpu", False),
        ]
        finals = drain(core)
    assert torch.equal(finals[low].image_batch, solo_images("0", 0, "cpu"))


@pytest.mark.parametrize("value", [-1, 2**50 + 1, 1.5, True, "1GB"])
def test_a_bad_budget_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidFieldError, match="preempted_offload_bytes"):
        EngineConfig(device="cpu", preempted_offload_bytes=value)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_an_offloaded_state_sits_in_pinned_host_memory(solo_images: SoloImages) -> None:
    with open_core(LARGE_BUDGET, device="cuda") as core:
        (low,) = preempt_lows(core, 1)
        assert core.collective_rpc("state_devices", (low,), unique_reply_rank=0) == [
            ("cpu", True),
            ("cpu", True),
        ]
        resume(core, low)
        assert core.collective_rpc("state_devices", (low,), unique_reply_rank=0) == [
            ("cuda", False),
            ("cuda", False),
        ]
        finals = drain(core)
    assert torch.equal(finals[low].image_batch, solo_images("0", 0, "cuda"))


def test_every_tensor_of_a_state_is_mapped_once_and_aliases_stay_aliases() -> None:
    cpu = torch.device("cpu")
    pipeline = build_pipeline("digits", cpu, {})
    state = pipeline.prepare_encode(PipelineRequest("r", "3", LOW, 7, cpu))
    (model_output,) = pipeline.denoise_step([state])
    pipeline.step_scheduler(state, model_output)
    labels, x0, generator = state.conditioning, state.scheduler.x0, state.request.generator
    state.conditioning = {"labels": labels, "pair": (state.latents, x0), "scale": 2.0}
    reached: list[torch.Tensor] = []

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        reached.append(tensor)
        return tensor.clone()

    map_state_tensors(state, copy)
    assert len(reached) == 3, "latents, labels and x0, each once"
    assert state.scheduler.x0 is not x0 and torch.equal(state.scheduler.x0, x0)
    assert state.conditioning["labels"] is not labels
    assert torch.equal(state.conditioning["labels"], labels)
    assert state.conditioning["pair"][0] is state.latents
    assert state.conditioning["pair"][1] is state.scheduler.x0
    assert state.request.generator is generator


def test_the_state_idle_longest_is_offloaded_first() -> None:
    cpu = torch.device("cpu")
    pipeline = build_pipeline("digits", cpu, {})
    states = {rid: pipeline.prepare_encode(PipelineRequest(rid, "1", LOW, 0, cpu)) for rid in "abc"}
    one_state = states["a"].latents.nbytes + states["a"].conditioning.nbytes
    offloader = StateOffloader(cpu, budget_bytes=one_state)
    offloader.place(states, ["a", "b", "c"])
    offloader.place(states, ["b", "c"])
    offloader.place(states, ["c"])
    assert offloader.offloaded_ids() == ["a"], "a has been idle longest; b does not fit"
    offloader.place(states, ["a", "c"])
    assert offloader.offloaded_ids() == ["b"] and offloader.offloaded_bytes == one_state
    offloader.forget(["b"])
    assert offloader.offloaded_ids() == [] and offloader.offloaded_bytes == 0


# Raised inside diffusers' sigma schedulers under numpy 2 (not by the runtime).
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_a_diffusers_multistep_state_continues_unchanged_after_its_tensors_are_replaced() -> None:
    """The walk reaches a diffusers scheduler's own tensors (the multistep solver's
    history) and leaves its frozen config alone: copying every tensor of a state mid-way,
    as an offload to another device does, changes none of its images."""
    pytest.importorskip("diffusers")
    import diffusers_models as models

    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    pipe = models.with_scheduler(models.dit_pipeline(), "DPMSolverMultistepScheduler")
    adapter = DiffusersPipeline(pipe, rows_per_call=8)
    params = SamplingParams(num_inference_steps=4, guidance_scale=3.0)
    cpu = torch.device("cpu")
    states = [adapter.prepare_encode(PipelineRequest(rid, 1, params, 5, cpu)) for rid in "ab"]
    reached: list[torch.Tensor] = []

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        reached.append(tensor)
        return tensor.clone()

    for step in range(params.num_inference_steps):
        if step == 2:
            history = list(states[1].scheduler.model_outputs)
            map_state_tensors(states[1], copy)
            assert any(t is history[-1] for t in reached), "the solver's history is reached"
        for state in states:
            (model_output,) = adapter.denoise_step([state])
            adapter.step_scheduler(state, model_output)
    assert torch.equal(adapter.post_decode(states[0]), adapter.post_decode(states[1]))


def test_the_offload_benchmark_reports_its_ratios_at_a_tiny_size() -> None:
    from diffusion_runtime.bench.offload import run

    results = run(requests=2, low_steps=5, high_steps=2, repeats=1)
    assert results["images_identical"]
    assert results["offloaded_while_preempted"] == {
        "off": 0,
        "off_twin": 0,
        "none_fit": 0,
        "all_fit": 2,
    }
    assert all(results[f"{name}_step_time_vs_off"] > 0 for name in ("none_fit", "all_fit"))
