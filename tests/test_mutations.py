"""Proof by mutation: the harness fails on each deliberately broken runtime, and
passes on the real one while reaching every path the catalogue depends on.

By default a representative subset of the catalogue runs (one or more per
layer); ``pytest -m slow`` runs all of it.
"""

from __future__ import annotations

import time
from typing import Any

import hypothesis.strategies as st
import pytest
from conftest import engine_threads
from hypothesis.stateful import RuleBasedStateMachine

from diffusion_runtime import EngineConfig
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine, core_lifecycle_machine
from diffusion_runtime.testing.deadline_harness import (
    TICK_S,
    DeadlineCoreLifecycleMachine,
    PatientEarliestDeadline,
    tick_deadlines,
)
from diffusion_runtime.testing.gap_mutations import PriorityPreemptingScheduler
from diffusion_runtime.testing.harness import EngineLifecycleMachine, lifecycle_machine
from diffusion_runtime.testing.lockstep import lockstep_machine
from diffusion_runtime.testing.mutations import CATALOGUE, Mutation, hunt, passes
from diffusion_runtime.testing.stage_front import StageFront
from diffusion_runtime.testing.strategies import sampling_params

MAX_EXAMPLES = 150
#: Examples for the mp target, whose engines start worker processes (about 0.3 s each).
MP_EXAMPLES = 40
#: Examples for the stage target, whose examples each start a stage process (1-5 s):
#: at most this many to catch a mutation, and this many for a passing run.
STAGE_EXAMPLES = 20
STAGE_PASS_EXAMPLES = 60  # "close with blocked readers" came 0, 1 and 4 times in 40
CATCH_LIMIT_S = 60.0
#: Examples for a passing run of the lockstep harness (about 20 ms each): its races
#: need a request queued or running when they are drawn.
LOCKSTEP_EXAMPLES = 300
#: Examples for each passing run of the deadline harness (four run by default): at
#: 100, one order of test files reached a drop while preempted only 4 times.
DEADLINE_EXAMPLES = 200
#: Examples for the patient target to catch a mutation: the rarer of its bugs needs a
#: running set with two places free while aged requests of both keys and a young one
#: of the running key wait (about 400 examples; each takes about 13 ms).
PATIENT_EXAMPLES = 1500
#: Examples a core-driven target may take to catch a mutation (about 12 ms each).
#: The bugs whose path is rare take 100-150 by the draws, and the draws move with
#: every rule added: the budget leaves room, and a caught bug stops the hunt.
CATCH_EXAMPLES = 500

FAST_SUBSET = {
    "results-by-position",
    "stream-not-woken",
    "wave-over-capacity",
    "request-waves-mix-steps",
    "running-abort-ignored",
    "completes-a-step-early",
    "one-step-short",
    "late-aborts-after-results",
    "death-spares-waiting",
    "preview-marked-final",
    "mp-stale-reply-taken",
    "dropped-consumer-not-aborted",
    "resume-starts-over",
    "resume-from-noise",
    "preemption-frees-state",
    "preempted-in-wave",
    "preempted-end-leaks-state",
    "restore-keeps-offload-entry",
    "deadline-drops-running",
    "preempted-deadline-forgotten",
    "stage-exit-skips-core-shutdown",
    "stage-batch-failed-child-completes",
    "inbox-apart-from-pause",
    "missing-result-fails-wave",
    "own-step-failure-fails-step",
    "staging-buffer-reused",
    "user-preemption-readmits",
    "queue-time-until-the-end",
    "drive-idles-before-done",
}

#: Paths the catalogue depends on, and how often a passing run must reach each.
#: Hypothesis seeds part of its generation with constants from the modules
#: loaded so far, so counts differ between a lone file and the whole suite,
#: and move when any module of the package changes: keep margins.
REQUIRED_REACH = {
    "core": {
        "path: a wave mixing failing and good requests": 10,
        "path: scheduler refused a duplicate id": 10,
        "path: finished id admitted again": 5,
        "path: abort of a running request during its wave": 5,
        "path: close with active requests": 5,
        "path: death with other requests active": 5,
        "path: RPC timeout refused": 5,
        "path: a request excused by a batch mate's forward failure": 3,
        "path: delivered images re-checked after later waves": 100,
        "rule: fill, then urgent work": 50,
    },
    "step": {"rule: abort a RUNNING request": 5, "path: progress output": 20},
    "mp": {"path: RPC timed out": 1, "path: RPC answered": 3},
    "user-scheduler": {
        "path: preempted": 20,
        "path: resumed": 10,
        "path: a preempted request completed as the oracle": 5,
        "path: abort of a preempted request": 3,
    },
    "preempt": {
        "path: preempted": 20,
        "path: resumed": 10,
        "path: a preempted request completed as the oracle": 5,
        "path: abort of a preempted request": 5,
        "path: close with a preempted request": 3,
        "path: a preempted state in host memory": 150,
        "path: resumed from host memory": 5,
    },
    "deadline-slo-drop": {
        "path: a RUNNING request reached its deadline": 10,
        "path: dropped at its deadline": 20,
        "path: dropped at its deadline while preempted": 3,
        "path: a deadline fell exactly on a step": 8,
        "path: an aged request ran first": 5,
    },
    "deadline-slo-run_late": {
        "path: slo demoted a late request": 30,
        "path: a late request completed": 15,
        "path: a deadline fell exactly on a step": 2,
        "path: an aged request ran first": 60,
    },
    "deadline-edf-drop": {
        "path: edf preempted for an earlier deadline": 12,
        "path: dropped at its deadline": 40,
        "path: dropped at its deadline while preempted": 8,
        "path: a deadline fell exactly on a step": 5,
        "path: an aged request ran first": 30,
    },
    "deadline-patient": {
        "path: a running set with room held a request back for an aged one": 10,
        "path: a younger request went first by its deadline": 10,
        "path: an aged request ran first": 30,
        "path: a late request completed": 30,
    },
    "front": {
        "path: close with blocked readers": 5,
        "path: consumer dropped while its request was active": 5,
    },
    "lockstep": {
        "path: close with blocked readers": 5,
        "path: consumer dropped while its request was active": 5,
        "path: raced at admission": 5,
        "path: raced at wave": 5,
        "path: raced at end": 5,
        "path: resumed with requests queued": 5,
        "path: resumed with aborts queued": 3,
        "path: generate timed out while paused": 3,
    },
    "stage": {  # 60 examples a mode: far fewer than the others, so counts move more
        "path: consumer dropped while its request was active": 5,
        "path: death with blocked readers": 5,
        "path: close with blocked readers": 1,
        "rule: batch of prompts": 20,
        "path: a batch parent with a failing child": 1,  # 4 in step mode, 49 in request
        "path: a batch parent completed": 8,
        "path: a batch parent aborted before its children were admitted": 4,
        "path: a RUNNING batch parent aborted": 4,  # when the abort beats the children's ends
    },
}


def params(
    mode: str,
    priorities: tuple[int, int] = (0, 0),
    deadline_s: st.SearchStrategy[float | None] | None = None,
) -> st.SearchStrategy:  # type: ignore[type-arg]
    # Step mode needs requests that stay running long enough to be aborted mid-flight.
    steps = (1, 3) if mode == "request" else (2, 6)
    return sampling_params(
        steps=steps,
        outputs=(1, 2),
        guidance=[1.0, 2.0],
        priorities=priorities,
        deadlines=deadline_s,
    )


def config(
    mode: str,
    backend: str = "uni",
    policy: str | type = "fifo",
    max_num_seqs: int = 2,  # small, so waves fill up and overfill when a policy is wrong
    **more: Any,
) -> EngineConfig:
    return EngineConfig(
        pipeline="testing-faults",
        device="cpu",
        max_num_seqs=max_num_seqs,
        execution_mode=mode,
        executor_backend=backend,
        streaming_output=mode == "step",  # streaming selects step mode
        preview_interval=1,
        scheduling_policy=policy,
        **more,
    )


def core_harness(mode: str, backend: str = "uni") -> type[CoreLifecycleMachine]:
    return core_lifecycle_machine(
        lambda: config(mode, backend),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        fatal_prompts=st.just("device-fault") if backend == "uni" else None,
        params=params(mode),
        # On mp a microsecond is too short for any reply: the late one must be dropped.
        rpc_timeouts=st.sampled_from([1e-6, None, 5.0]),
    )


def preempt_harness() -> type[CoreLifecycleMachine]:
    """The step-mode core under the preemptive priority policy, priorities drawn per
    request: a better-ranked arrival preempts a running request, which resumes later.
    The offload budget holds about two preempted states, so some resume from host
    memory and some from the device."""
    return core_lifecycle_machine(
        lambda: config("step", policy="priority", preempted_offload_bytes=16 * 2**10),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        fatal_prompts=st.just("device-fault"),
        params=params("step", priorities=(0, 3)),
        rpc_timeouts=st.sampled_from([1e-6, None, 5.0]),
    )


def user_scheduler_harness() -> type[CoreLifecycleMachine]:
    """The default core harness (no priority drawn) with a user's scheduler that
    preempts on priority: its own rules must make it preempt."""
    return core_lifecycle_machine(
        lambda: config("step"),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        params=params("step"),
        scheduler_cls=PriorityPreemptingScheduler,
    )


def deadline_harness(
    policy: str | type = "slo", miss: str = "drop", mode: str = "step", max_num_seqs: int = 2
) -> type[CoreLifecycleMachine]:
    """The core on a virtual clock under a deadline-aware policy: deadlines and
    priorities drawn per request; aging after 24 ticks, so it is reached."""
    return core_lifecycle_machine(
        lambda: config(
            mode,
            policy=policy,
            max_num_seqs=max_num_seqs,
            deadline_miss=miss,
            scheduling_aging_s=24 * TICK_S,
        ),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        fatal_prompts=st.just("device-fault"),
        params=params(mode, priorities=(0, 3), deadline_s=tick_deadlines()),
        rpc_timeouts=st.sampled_from([1e-6, None, 5.0]),
        base=DeadlineCoreLifecycleMachine,
    )


def patient_harness() -> type[CoreLifecycleMachine]:
    """The deadline harness under a policy that reorders but never preempts, with
    room for three: a running set with places free while an aged request of
    another key waits (the aging bound's form without preemption)."""
    return deadline_harness(PatientEarliestDeadline, "run_late", max_num_seqs=3)


def front_harness(mode: str) -> type[EngineLifecycleMachine]:
    machine = lifecycle_machine(
        lambda: front_config(mode),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        params=params(mode),
    )
    machine.read_timeout_s = 3.0  # a hung stream fails the example instead of the suite
    return machine


def front_config(mode: str) -> EngineConfig:
    return EngineConfig(
        pipeline="testing-faults", device="cpu", max_num_seqs=3, execution_mode=mode
    )


def stage_harness(mode: str) -> type[EngineLifecycleMachine]:
    return lifecycle_machine(
        lambda: stage_config(mode),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        params=params(mode),
        read_timeout_s=3.0,  # a hung stream fails the example instead of the suite
        front=StageFront,
    )


def stage_config(mode: str) -> EngineConfig:
    return EngineConfig(
        pipeline="testing-faults",
        device="cpu",
        max_num_seqs=3,
        execution_mode=mode,
        warmup=False,  # a stage starts per example
        intra_op_threads=1,
    )


def lockstep_harness(mode: str) -> type[EngineLifecycleMachine]:
    return lockstep_machine(
        lambda: front_config(mode),
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing", "bad-step"]),
        params=params(mode),
        read_timeout_s=3.0,  # a hung stream fails the example instead of the suite
    )


def harness_for(target: str, mode: str) -> type[RuleBasedStateMachine]:
    if target == "front":
        return front_harness(mode)
    if target == "lockstep":
        return lockstep_harness(mode)
    if target == "stage":
        return stage_harness(mode)
    if target == "preempt":
        return preempt_harness()
    if target == "user-scheduler":
        return user_scheduler_harness()
    deadline_targets = {
        "deadline-drop": lambda: deadline_harness("slo", "drop"),
        "deadline-run_late": lambda: deadline_harness("slo", "run_late"),
        "deadline-patient": patient_harness,
    }
    if target in deadline_targets:
        return deadline_targets[target]()
    return core_harness(mode, "mp" if target == "mp" else "uni")


def test_catalogue_is_large_and_named_uniquely() -> None:
    assert len(CATALOGUE) >= 30
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    assert {m.target for m in CATALOGUE} == {
        "core",
        "mp",
        "front",
        "lockstep",
        "preempt",
        "deadline-drop",
        "deadline-run_late",
        "deadline-patient",
        "stage",
        "user-scheduler",
    }
    assert {m.name for m in CATALOGUE} >= FAST_SUBSET


def passes_and_reaches(
    machine: type[RuleBasedStateMachine], examples: int, required: dict[str, int]
) -> None:
    """The real runtime passes ``examples`` examples of ``machine`` and reaches each
    required path at least as often as required; no engine thread is left."""
    passes(machine, examples)
    reach = machine.reach  # type: ignore[attr-defined]
    print(reach.table())
    assert not reach.missing(required), f"paths reached too rarely: {reach.missing(required)}"
    assert engine_threads() == []


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("target", ["core", "front", "lockstep"])
def test_the_real_runtime_passes_and_reaches_every_path(target: str, mode: str) -> None:
    required = dict(REQUIRED_REACH[target])
    if target == "core" and mode == "step":
        required.update(REQUIRED_REACH["step"])
    examples = LOCKSTEP_EXAMPLES if target == "lockstep" else MAX_EXAMPLES
    passes_and_reaches(harness_for(target, mode), examples, required)


def test_the_real_runtime_passes_with_preemption_and_reaches_every_path() -> None:
    passes_and_reaches(preempt_harness(), MAX_EXAMPLES, REQUIRED_REACH["preempt"])


def test_a_users_preempting_scheduler_preempts_under_the_default_rules() -> None:
    passes_and_reaches(user_scheduler_harness(), MAX_EXAMPLES, REQUIRED_REACH["user-scheduler"])


@pytest.mark.parametrize(
    ("policy", "miss"), [("slo", "drop"), ("slo", "run_late"), ("edf", "drop")]
)
def test_the_real_runtime_meets_deadlines_on_a_virtual_clock(policy: str, miss: str) -> None:
    required = REQUIRED_REACH[f"deadline-{policy}-{miss}"]
    passes_and_reaches(deadline_harness(policy, miss), DEADLINE_EXAMPLES, required)


def test_the_real_runtime_keeps_the_aging_bound_without_preemption() -> None:
    passes_and_reaches(patient_harness(), DEADLINE_EXAMPLES, REQUIRED_REACH["deadline-patient"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "miss", "mode"),
    [("edf", "run_late", "step"), ("slo", "drop", "request"), ("edf", "run_late", "request")],
)
def test_the_real_runtime_meets_deadlines_in_every_configuration(
    policy: str, miss: str, mode: str
) -> None:
    passes(deadline_harness(policy, miss, mode), MAX_EXAMPLES)


@pytest.mark.slow
def test_the_real_runtime_passes_on_mp() -> None:
    machine = core_harness("step", "mp")
    passes(machine, MP_EXAMPLES)
    print(machine.reach.table())
    assert not machine.reach.missing(REQUIRED_REACH["mp"]), machine.reach.table()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_real_runtime_passes_on_the_stage(mode: str) -> None:
    machine = stage_harness(mode)
    passes(machine, STAGE_PASS_EXAMPLES)
    print(machine.reach.table())
    assert not machine.reach.missing(REQUIRED_REACH["stage"]), machine.reach.table()


def catch(mutation: Mutation) -> None:
    examples = {
        "mp": MP_EXAMPLES,
        "stage": STAGE_EXAMPLES,
        "deadline-patient": PATIENT_EXAMPLES,
    }.get(mutation.target, CATCH_EXAMPLES)
    start = time.monotonic()
    caught = hunt(mutation, harness_for(mutation.target, mutation.mode), max_examples=examples)
    elapsed = time.monotonic() - start
    assert caught is not None, f"the harness missed: {mutation.bug}"
    print(f"{mutation.name}: caught after {caught} example(s) in {elapsed:.1f} s")
    assert elapsed < CATCH_LIMIT_S, f"{mutation.name} took {elapsed:.0f} s to catch"
    assert engine_threads() == []


@pytest.mark.parametrize(
    "mutation", [m for m in CATALOGUE if m.name in FAST_SUBSET], ids=lambda m: m.name
)
def test_the_harness_catches(mutation: Mutation) -> None:
    catch(mutation)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mutation", [m for m in CATALOGUE if m.name not in FAST_SUBSET], ids=lambda m: m.name
)
def test_the_harness_catches_the_rest(mutation: Mutation) -> None:
    catch(mutation)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_real_runtime_passes_a_thousand_examples(mode: str) -> None:
    """The thorough run: 1,000 examples of 60 rules, no violation, no flaky draws."""
    passes(core_harness(mode), 1000, steps=60)
