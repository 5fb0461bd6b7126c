"""Two-phase outputs: compute done, then output ready.

On the CPU the phases collapse (every fence is ready when a wave returns). The
core's side of the second phase is driven here with a fence the test opens by
hand: the edge under test is the copy to host memory, so that is what is held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
import pytest
import torch
from conftest import suite_device

from diffusion_runtime import DiffusionEngine, EngineConfig, RequestStatus, SamplingParams
from diffusion_runtime.contracts import READY, OutputFence, RunnerOutput, SchedulerOutput
from diffusion_runtime.core import EngineCore
from diffusion_runtime.delivery_queue import DeliveryQueue
from diffusion_runtime.executor.uni import UniProcExecutor
from diffusion_runtime.fsm import LifecycleEvent
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.runner.host_copy import HostCopier

PARAMS = SamplingParams(num_inference_steps=3, height=16, width=16)


class HeldFence(OutputFence):
    """A copy that stays in flight until it is waited for; records how many waves
    had been sent by then."""

    def __init__(self, executor: HeldCopies) -> None:
        self.executor = executor
        self.waited_after_waves: int | None = None

    def is_ready(self) -> bool:
        return self.waited_after_waves is not None

    def wait(self) -> None:
        if self.waited_after_waves is None:
            self.waited_after_waves = len(self.executor.fences)


class HeldCopies(UniProcExecutor):
    """The uni executor, with every wave's host copy in flight until waited for."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.fences: list[HeldFence] = []

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        result = super().execute(scheduler_output)
        self.fences.append(HeldFence(self))
        return attrs.evolve(result, output_ready=self.fences[-1])


def step_config(**overrides: object) -> EngineConfig:
    settings: dict[str, object] = {
        "pipeline": "testing-noise",
        "device": "cpu",
        "execution_mode": "step",
        "streaming_output": True,
        "preview_interval": 1,
        "audit": "raise",
        "warmup": False,
    }
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture
def held() -> Iterator[tuple[EngineCore, HeldCopies]]:
    config = step_config()
    executor = HeldCopies(config)
    core = EngineCore(config, executor=executor)
    yield core, executor
    core.shutdown()
    assert core.auditor is not None and not core.auditor.violations


def run_to_end(core: EngineCore) -> list[RequestOutput]:
    outputs = []
    while core.has_unfinished():
        outputs += core.step().outputs
    return outputs


def test_on_the_cpu_the_phases_collapse() -> None:
    copier = HostCopier(torch.device("cpu"))
    batch = torch.arange(12.0).reshape(3, 1, 2, 2)
    row = copier.to_host(batch[1:2])
    assert not copier.overlaps and copier.fence() is READY
    assert row._base is None and torch.equal(row, batch[1:2])  # owns its memory
    core = EngineCore(step_config(streaming_output=False))
    try:
        core.add_request("a", "cat", PARAMS, seed=3)
        # delivered with its own step
        [output] = [o for _ in range(3) for o in core.step().outputs]
        assert output.status is RequestStatus.FINISHED_COMPLETED
    finally:
        core.shutdown()


def test_the_next_step_is_sent_before_the_last_ones_outputs_are_waited_for(
    held: tuple[EngineCore, HeldCopies],
) -> None:
    core, executor = held
    ended: list[LifecycleEvent] = []
    core.machine.subscribe(
        lambda e: ended.append(e) if isinstance(e, LifecycleEvent) and e.dest.is_finished else None
    )
    core.add_request("a", "cat", PARAMS, seed=3)
    assert core.step().outputs == []  # step 1 is enqueued; its output is still being copied
    assert [(o.step, o.finished) for o in core.step().outputs] == [(1, False)]
    assert executor.fences[0].waited_after_waves == 2  # waited for once step 2 was sent
    assert [(o.step, o.finished) for o in core.step().outputs] == [(2, False)]
    # The request completed with step 3, but its images are still on their way.
    assert [(e.request_id, e.dest) for e in ended] == [("a", RequestStatus.FINISHED_COMPLETED)]
    assert core.has_unfinished() and not executor.fences[2].is_ready()
    [final] = core.step().outputs  # nothing left to run: the core waits for the copy
    assert final.finished and final.status is RequestStatus.FINISHED_COMPLETED
    reference = EngineCore(step_config())
    try:
        reference.add_request("a", "cat", PARAMS, seed=3)
        expected = run_to_end(reference)[-1].image_batch
    finally:
        reference.shutdown()
    assert final.image_batch is not None and expected is not None
    assert torch.equal(final.image_batch, expected)


def test_an_abort_between_the_phases_drops_the_outputs_still_in_flight(
    held: tuple[EngineCore, HeldCopies],
) -> None:
    core, _ = held
    core.add_request("a", "cat", PARAMS, seed=3)
    core.add_request("b", "dog", PARAMS, seed=4)
    assert core.step().outputs == []  # both outputs of step 1 are in flight
    core.abort(["a"])  # the consumer went away between the two phases
    outputs = run_to_end(core)
    by_request = {rid: [o for o in outputs if o.request_id == rid] for rid in "ab"}
    assert [o.status for o in by_request["a"]] == [RequestStatus.FINISHED_ABORTED]
    assert [o.step for o in by_request["b"]] == [1, 2, 3]
    assert not core.snapshot().runner_cached_ids


def test_outputs_leave_in_order_even_when_a_later_copy_lands_first() -> None:
    class Gate(OutputFence):
        def __init__(self) -> None:
            self.open = False

        def is_ready(self) -> bool:
            return self.open

        def wait(self) -> None:
            self.open = True

    first, second = Gate(), Gate()
    queue: DeliveryQueue[str] = DeliveryQueue()
    queue.put(["a1", "b1"], first)
    queue.put(["a2"], second)
    queue.put(["abort b"])
    second.open = True
    assert queue.take(wait=False) == []
    queue.discard(lambda item: item == "b1")
    first.open = True
    assert queue.take(wait=False) == ["a1", "a2", "abort b"] and not queue


@pytest.mark.parametrize("mode", ["request", "step"])
def test_overlap_on_and_off_deliver_the_same_outputs_in_the_same_order(
    make_engine: Callable[..., DiffusionEngine], mode: str
) -> None:
    """On the suite's device (``--device``): on CUDA the copies overlap later steps."""
    params = [SamplingParams(num_inference_steps=s, seed=s) for s in (2, 4, 3)]
    prompts = ["1", "7", "3"]
    results = []
    for overlap in (True, False):
        engine = make_engine(
            "digits",
            device=suite_device(),
            execution_mode=mode,
            max_num_seqs=3,
            overlap_outputs=overlap,
            audit="raise",
            warmup=False,
        )
        results.append(engine.generate(prompts, params))
    for on, off in zip(*results, strict=True):
        assert on.ok and off.ok and on.seed == off.seed
        assert on.image_batch is not None and off.image_batch is not None
        assert on.image_batch.device.type == "cpu"
        assert torch.equal(on.image_batch, off.image_batch)


def test_a_cuda_copy_lands_in_pinned_memory_once_its_fence_is_ready() -> None:
    if suite_device() != "cuda":
        pytest.skip("needs --device cuda")
    device = torch.device("cuda", 0)
    copier = HostCopier(device)
    weights = torch.randn(2048, 2048, device=device)
    images = (weights @ weights).reshape(4, 1, 1024, 1024)  # kernels still running
    hosts = [copier.to_host(images[i : i + 1]) for i in range(4)]
    fence = copier.fence()
    assert copier.overlaps and fence is not READY and copier.fence() is READY
    del images  # the device memory stays reserved until the side stream has read it
    fence.wait()
    assert fence.is_ready() and all(host.is_pinned() for host in hosts)
    expected = (weights @ weights).reshape(4, 1, 1024, 1024).cpu()
    assert all(torch.equal(host, expected[i : i + 1]) for i, host in enumerate(hosts))
