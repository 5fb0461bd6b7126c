"""Step-level preemption, deadlines and policies through the real engine core and the
digits pipeline, with the auditor attached: preempted-then-resumed images are
bit-identical to an uninterrupted run, and nothing of a preempted request is
left once it ends, however it ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from executor_helpers import drain
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_runtime import DiffusionEngine, EngineConfig, EngineDeadError, SamplingParams
from diffusion_runtime.contracts import SchedulerOutput
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import LifecycleEvent, RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.scheduler import DEADLINE_REASON, BaseScheduler, Request

S = RequestStatus
LOW = SamplingParams(
    num_inference_steps=12, priority=5, num_outputs_per_prompt=2, guidance_scale=2.0
)
HIGH = SamplingParams(num_inference_steps=4)


def make_core(mode: str = "step", audit: str = "raise", **config: Any) -> EngineCore:
    config.setdefault("scheduling_policy", "priority")
    config.setdefault("max_num_seqs", 1)
    config.setdefault("pipeline", "digits")
    return EngineCore(
        EngineConfig(
            device="cpu",
            execution_mode=mode,
            warmup=False,
            audit=audit,
            **config,
        )
    )


@contextlib.contextmanager
def open_core(**config: Any) -> Iterator[EngineCore]:
    core = make_core(**config)
    try:
        yield core
    finally:
        core.shutdown()


def steps(core: EngineCore, count: int) -> list[RequestOutput]:
    return [o for _ in range(count) for o in core.step().outputs]


SoloImages = Callable[[str, SamplingParams, int], torch.Tensor]


@pytest.fixture(scope="module")
def solo_images() -> Iterator[SoloImages]:
    """A request's images when it runs alone, uninterrupted, under the default policy."""
    with open_core(scheduling_policy="fifo") as core:

        def run_alone(prompt: str, params: SamplingParams, seed: int) -> torch.Tensor:
            core.add_request("solo", prompt, params, seed)
            images = drain(core)["solo"].image_batch
            assert images is not None
            return images

        yield run_alone


def preempt_low(core: EngineCore) -> None:
    """Run "low" for a few steps, then admit "high", which preempts it."""
    core.add_request("low", "3", LOW, seed=7)
    steps(core, 5)
    core.add_request("high", "5", HIGH, seed=1)
    core.step()
    assert core.scheduler.requests["low"].state is S.PREEMPTED


def test_preempted_then_resumed_output_is_bit_identical_to_an_uninterrupted_run(
    solo_images: SoloImages,
) -> None:
    with open_core() as core:
        preempt_low(core)
        low = core.scheduler.requests["low"]
        snapshot = core.snapshot()
        assert low.step_index == 5 and "low" not in snapshot.running_ids
        assert "low" in snapshot.runner_cached_ids, "its runner state is kept, not rebuilt"
        finals = drain(core)
        assert core.scheduler.num_preemptions == 1
        assert core.auditor is not None and core.auditor.violations == []
    assert finals["high"].ok and finals["low"].ok
    assert finals["low"].step == finals["low"].num_steps == LOW.num_inference_steps
    assert torch.equal(finals["low"].image_batch, solo_images("3", LOW, seed=7))


@pytest.mark.parametrize("end", ["abort", "shutdown"])
def test_a_request_that_ends_while_preempted_leaves_nothing(end: str) -> None:
    core = make_core()
    try:
        preempt_low(core)
        if end == "abort":
            core.abort(["low"])
            [aborted] = core.step().outputs  # applied, and released, by the next step
            snapshot = core.snapshot()
            assert "low" not in snapshot.runner_cached_ids | snapshot.scheduler_ids
            finals = {aborted.request_id: aborted, **drain(core)}
        else:
            finals = {o.request_id: o for o in core.shutdown()}
    finally:
        core.shutdown()
    assert finals["low"].status is S.FINISHED_ABORTED
    assert core.auditor is not None and core.auditor.complete
    assert core.auditor.violations == []


def test_a_device_fault_while_a_request_is_preempted_fails_it_and_leaves_nothing() -> None:
    core = make_core(pipeline="testing-faults")
    try:
        core.add_request("low", "a", SamplingParams(num_inference_steps=6, priority=5), seed=0)
        steps(core, 2)
        core.add_request("fault", "device-fault", SamplingParams(num_inference_steps=3), seed=0)
        with pytest.raises(EngineDeadError):
            core.step()  # "low" is preempted, then the step of "fault" kills the device
        assert core.scheduler.num_preemptions == 1 and not core.scheduler.requests
    finally:
        core.shutdown()
    assert core.auditor is not None and core.auditor.dead
    assert core.auditor.violations == []


def test_deadline_passed_while_waiting_drops_or_runs_late() -> None:
    late = SamplingParams(num_inference_steps=2, deadline_s=0.5)
    an_hour_ago = time.monotonic() - 3600.0
    for action, status in [("drop", S.FINISHED_ABORTED), ("run_late", S.FINISHED_COMPLETED)]:
        with open_core(deadline_miss=action, scheduling_policy="edf") as core:
            core.add_request("late", "1", late, seed=0, arrival_time=an_hour_ago)
            core.add_request("fresh", "2", late, seed=0)
            finals = drain(core)
        assert finals["late"].status is status and finals["fresh"].ok
        if action == "drop":
            assert finals["late"].error == DEADLINE_REASON


# -- the auditor catches broken preemption (faults injected on purpose) -----------------------


def release_on_preempt(original: Any) -> Any:
    """The runtime's old behaviour: preempted state dropped, so resuming has nothing."""

    def on_preempted(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
        original(self, request, event)
        self._finished_ids.append(request.request_id)

    return on_preempted


def resume_from_scratch(original: Any) -> Any:
    """Resumed requests sent as new: the runner starts them over from step 0."""

    def build_output(
        self: BaseScheduler, new: list[Request], cached_ids: tuple[str, ...] = (), resumed: Any = ()
    ) -> SchedulerOutput | None:
        resumed_ids = {r.request_id for r in resumed}
        cached = tuple(rid for rid in cached_ids if rid not in resumed_ids)
        return original(self, [*resumed, *new], cached)  # type: ignore[no-any-return]

    return build_output


def preempted_state_kept_on_abort(original: Any) -> Any:
    """Only running requests are reported finished to the workers."""

    def on_terminal(self: BaseScheduler, request: Request, event: LifecycleEvent) -> None:
        before = list(self._finished_ids)
        original(self, request, event)
        if event.source is S.PREEMPTED:
            self._finished_ids[:] = before

    return on_terminal


@pytest.mark.parametrize(
    ("owner", "name", "bug", "invariant"),
    [
        (BaseScheduler, "_on_preempted", release_on_preempt, "INV-006"),
        (BaseScheduler, "build_output", resume_from_scratch, "INV-006"),
        (BaseScheduler, "_on_terminal", preempted_state_kept_on_abort, "INV-003"),
    ],
)
def test_the_auditor_catches_broken_preemption(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, bug: Any, invariant: str
) -> None:
    monkeypatch.setattr(owner, name, bug(owner.__dict__[name]))
    core = make_core(audit="report")
    try:
        preempt_low(core)
        if name == "_on_terminal":
            core.abort(["low"])
        else:
            drain(core)
    finally:
        core.shutdown()
    assert core.auditor is not None
    assert invariant in {v.invariant for v in core.auditor.violations}


# -- random workloads in both modes, with the auditor attached ----------------------------------

request_specs = st.tuples(
    st.integers(0, 9),  # digit
    st.integers(1, 6),  # steps
    st.integers(-2, 2),  # priority
    st.sampled_from([None, 0.001, 5.0]),  # deadline_s
    st.booleans(),  # a 16x16 output (another batch key)
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), request_specs),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ),
    max_size=14,
)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["request", "step"]),
    policy=st.sampled_from(["fifo", "priority", "edf", "slo"]),
    deadline_miss=st.sampled_from(["drop", "run_late"]),
    ops=operations,
)
def test_random_workloads_keep_every_invariant_and_every_image(
    solo_images: SoloImages, mode: str, policy: str, deadline_miss: str, ops: list[tuple[str, Any]]
) -> None:
    added: list[tuple[str, str, SamplingParams]] = []
    finals: dict[str, RequestOutput] = {}
    with open_core(
        mode=mode, scheduling_policy=policy, deadline_miss=deadline_miss, max_num_seqs=2
    ) as core:
        for op, arg in ops:
            if op == "add":
                digit, count, priority, deadline_s, big = arg
                size = 16 if big else None
                params = SamplingParams(
                    num_inference_steps=count,
                    priority=priority,
                    deadline_s=deadline_s,
                    height=size,
                    width=size,
                )
                rid = f"r{len(added)}"
                core.add_request(rid, str(digit), params, seed=len(added))
                added.append((rid, str(digit), params))
            elif op == "step":
                finals.update({o.request_id: o for o in steps(core, arg) if o.finished})
            elif added:
                core.abort([added[arg % len(added)][0]])
        finals.update(drain(core))
        assert core.snapshot().runner_cached_ids == frozenset()
        assert core.auditor is not None and core.auditor.violations == []
    assert set(finals) == {rid for rid, _, _ in added}
    for index, (rid, prompt, params) in enumerate(added):
        if finals[rid].ok:
            assert torch.equal(finals[rid].image_batch, solo_images(prompt, params, index))


def test_the_engine_front_serves_every_policy(make_engine: Any) -> None:
    prompts = [str(d) for d in range(6)]
    params = [
        SamplingParams(num_inference_steps=n, priority=-n, deadline_s=1.0 + n, seed=n)
        for n in (2, 5, 3, 6, 1, 4)
    ]
    for policy in ("priority", "edf", "slo"):
        engine: DiffusionEngine = make_engine(
            "digits", execution_mode="step", max_num_seqs=2, scheduling_policy=policy, audit="raise"
        )
        outputs = engine.generate(prompts, params)
        assert [o.request_id for o in outputs] and all(o.ok for o in outputs)
        engine.close()
        assert engine.auditor is not None and engine.auditor.violations == []
