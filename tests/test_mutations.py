"""Proof by mutation: the harness fails on each deliberately broken runtime, and
passes on the real one while reaching every path the catalogue depends on.

By default a representative subset of the catalogue runs (one or more per
layer); ``pytest -m slow`` runs all of it.
"""

from __future__ import annotations

import time

import pytest
from conftest import engine_threads
from hypothesis.stateful import RuleBasedStateMachine

from diffusion_runtime.testing.mutations import CATALOGUE, Mutation, hunt, passes
from diffusion_runtime.testing.targets import (
    HARNESSES,
    cache_harness,
    core_harness,
    deadline_harness,
    harness_for,
    lora_harness,
    outputs_harness,
    patient_harness,
    preempt_harness,
    stage_harness,
    user_scheduler_harness,
)

MAX_EXAMPLES = 200
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
#: Examples for each passing run of the cfg-parallel target (a worker group starts per
#: example, about 16 s each on two cores).
CFG_PARALLEL_EXAMPLES = 4
#: Examples for each passing run of the ulysses and ring targets (a worker group of
#: the DiT starts per example).
SEQUENCE_PARALLEL_EXAMPLES = 4
#: Examples for each passing run of the adapter target (digits, about 0.4 s each).
LORA_EXAMPLES = 100
#: The outputs target's passing run (each example's oracle steps every request alone).
OUTPUTS_EXAMPLES = 60
OUTPUTS_FRONT_EXAMPLES = 100
#: Examples for each passing run of the cache target (digits, about 0.5-1 s each).
CACHE_EXAMPLES = 40
#: The cache-dit target's passing run (a tiny DiT, about 1-2 s each).
CACHE_DIT_EXAMPLES = 12
#: The cache-mp target's passing run (a worker group per example).
CACHE_MP_EXAMPLES = 10

FAST_SUBSET = {
    "cache-decided-over-batch",
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
    "mp-release-not-sent",  # the mp layer's (mp-stale-reply-taken took 50 s beside another worker)
    "dropped-consumer-not-aborted",
    "resume-starts-over",
    "resume-from-noise",
    "preemption-frees-state",
    "preempted-in-wave",
    "preempted-end-leaks-state",
    "restore-keeps-offload-entry",
    "deadline-drops-running",
    "preempted-deadline-forgotten",
    "victim-ties-preempt-oldest",
    "edf-ignores-priority",
    "slo-parks-late",
    "stage-exit-skips-core-shutdown",
    "inbox-apart-from-pause",
    "missing-result-fails-wave",
    "own-step-failure-fails-step",
    "staging-buffer-reused",
    "user-preemption-readmits",
    "queue-time-until-the-end",
    "drive-idles-before-done",
    "costs-charged-after-commit",
    "progress-outlives-its-request",
    "delivery-ignores-the-fence",
    "batched-device-fault-kept-local",
    "batch-mate-adapter",
    "adapter-scale-ignored",
    "in-use-adapter-evicted",
    "pin-ignored-by-eviction",
    "in-use-adapter-removed",
    "wave-while-asleep",
    "level-2-reload-in-float64",
    "level-2-keeps-buffers",
    "waiting-dropped-at-sleep",
    "trajectory-last-step-dropped",
    "trajectory-of-a-batch-mate",
    "custom-timesteps-ignored-on-join",
    "group-merge-drops-last-child",
    "streamed-parts-share-one-counter",
    "cfg-branches-swapped",
    "cfg-padding-read-first",
}

#: Paths the catalogue depends on, and how often a passing run must reach each.
#: Hypothesis seeds part of its generation with constants from the modules
#: loaded so far, so counts differ between a lone file and the whole suite,
#: and move when any module of the package changes: keep margins.
REQUIRED_REACH = {
    # The parallel targets' fault rule: rank 1 killed, its peer's next collective fails.
    "parallel": {"rule: kill a worker": 1},
    "core": {
        "path: a wave mixing failing and good requests": 10,
        "path: scheduler refused a duplicate id": 10,
        "path: finished id admitted again": 5,
        "path: abort of a running request during its wave": 5,
        "path: close with active requests": 5,
        "path: death with other requests active": 5,
        "path: RPC timeout refused": 5,
        "path: a request excused by a batch mate's forward failure": 1,
        "path: delivered images re-checked after later waves": 100,
        "rule: fill, then urgent work": 50,
        "example: copies held in flight": 50,
        "path: the core waited on a copy in flight": 80,
        "path: a copy landed before the core waited on it": 15,
        # The sleep rules (testing/sleep_rules.py).
        "rule: sleep at level 1": 25,
        "rule: sleep at level 2": 15,
        "rule: wake": 20,
        "path: sleep with a queued request": 15,
        "path: sleep with a WAITING request": 10,
        "path: admitted while asleep": 100,
        "path: a WAITING request aborted while asleep": 30,
        "path: woke with requests waiting": 15,
        "path: a request that slept completed": 15,
        "path: closed while asleep": 8,
        "path: woken for the end": 5,
    },
    "step": {
        "rule: abort a RUNNING request": 5,
        "path: progress output": 20,
        "path: a request ended with its progress in flight": 15,
        # The runner's batched path (step_batch, post_decode_batch), drawn per example.
        "path: a wave mixing 'bad-step' and good requests, batched_steps=True": 3,
        "path: a wave mixing 'fail' and good requests, batched_steps=True": 2,
        "path: a wave mixing 'device-fault' and good requests, batched_steps=True": 1,
        "path: a wave producing several requests' images, batched_steps=True": 15,
        "path: sleep with a RUNNING request": 10,
        "path: a RUNNING request aborted while asleep": 5,
    },
    "mp": {"path: RPC timed out": 1, "path: RPC answered": 3},
    "user-scheduler": {
        "path: preempted": 20,
        "path: resumed": 10,
        "path: a preempted request completed as the oracle": 5,
        "path: abort of a preempted request": 3,
        "path: resumed before a request preempted earlier": 30,
    },
    "preempt": {
        "path: preempted": 20,
        "path: resumed": 10,
        "path: a preempted request completed as the oracle": 5,
        "path: abort of a preempted request": 5,
        "path: close with a preempted request": 3,
        "path: a preempted state in host memory": 150,
        "path: resumed from host memory": 5,
        "rule: preempt in turns": 50,
        "path: resumed before a request preempted earlier": 50,
        "path: sleep with a PREEMPTED request": 15,
        "path: a PREEMPTED request aborted while asleep": 5,
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
        "path: slo ran a late request in an on-time one's slack": 15,
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
        "path: a tie broken by priority": 200,
        "path: part of the running set preempted": 25,
    },
    "deadline-priority-drop": {
        "path: part of the running set preempted": 40,
        "path: a tie broken by admission order": 200,
        "path: a preemption tie broken by admission order": 8,
        "path: dropped at its deadline while preempted": 20,
        "path: an aged request ran first": 60,
    },
    "deadline-patient": {
        "path: a running set with room held a request back for an aged one": 10,
        "path: a younger request went first by its deadline": 10,
        "path: an aged request ran first": 30,
        "path: a late request completed": 30,
    },
    "outputs": {
        "output: latents": 50,
        "output: a trajectory (latents)": 40,
        "output: a trajectory (full)": 40,
        "output: log-probabilities of stochastic steps": 20,
        "output: custom timesteps": 30,
    },
    # The front target with output options (outputs-front), 100 examples per mode.
    "outputs-front-request": {
        "output: latents": 60,
        "output: a trajectory (full)": 40,
        "output: log-probabilities of stochastic steps": 8,
        "output: custom timesteps": 30,
        "output: a batch parent's merged trajectory": 20,
        "output: a batch parent's merged latents": 15,
    },
    "outputs-front-step": {
        "output: latents": 15,
        "output: custom timesteps": 10,
        # Step mode reaches completed grouped outputs rarely (2 each here, 16 and 7
        # before a harness module's constants moved the draws); the merge is the
        # same code in both modes, and request mode holds its minimums.
        "output: a batch parent's merged trajectory": 1,
        "output: a batch parent's merged latents": 1,
    },
    "outputs-step": {
        "output: a preempted request's trajectory": 30,
        "output: a preempted request on custom timesteps": 10,
    },
    "lora": {
        "adapter: add_lora loaded": 50,
        "adapter: add_lora refused, no room": 10,
        "adapter: evicted": 40,
        "adapter: pinned": 40,
        "adapter: refused": 10,
        "adapter: removed": 5,
        # 15 in request mode and 55 in step mode after the sleep rules moved the draws.
        "adapter: remove_lora refused while in use": 8,
        "rule: pin, then load the others": 20,
        "rule: requests with mixed adapters": 30,
        "path: a request with an adapter matched its merged network": 50,
    },
    # 40 examples reached these 247 times in request mode and 60 in step mode, where
    # 22 of them had been preempted (scaled from a 60-example run).
    "cache": {"path: a request reused cached model outputs as the oracle": 20},
    "cache-step": {"path: a preempted request reused cached outputs": 5},
    "lora-step": {
        "path: a wave of two adapters": 50,
        "path: a wave of an adapter and the base model": 50,
    },
    "front": {
        "path: close with blocked readers": 5,
        "path: consumer dropped while its request was active": 5,
        # The batch rules over the engine's grouped requests (200 examples a mode).
        "rule: batch of prompts": 100,
        "path: a batch parent completed": 50,
        "path: a batch parent with a failing child": 20,
        "path: a batch parent aborted before its children were admitted": 20,
        "path: a RUNNING batch parent aborted": 20,
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


def test_catalogue_is_large_and_named_uniquely() -> None:
    assert len(CATALOGUE) >= 30
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    assert {m.target for m in CATALOGUE} == set(HARNESSES)
    assert {m.name for m in CATALOGUE} >= FAST_SUBSET


@pytest.mark.parametrize("mutation", CATALOGUE, ids=lambda m: m.name)
def test_every_patch_still_applies(mutation: Mutation) -> None:
    """A patch whose method is gone would fail every hunt at once: it must apply
    (the hunt raises on it rather than count it caught)."""
    with mutation.patch():
        pass


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
def test_the_real_runtime_returns_latents_and_trajectories_as_the_oracle(mode: str) -> None:
    """The outputs target: every drawn latent output and trajectory (with its
    log-probabilities) equals the one the oracle records stepping alone."""
    required = dict(REQUIRED_REACH["outputs"])
    if mode == "step":
        required.update(REQUIRED_REACH["outputs-step"])
    passes_and_reaches(outputs_harness(mode), OUTPUTS_EXAMPLES, required)


def test_streamed_trajectory_parts_join_to_the_final_trajectory() -> None:
    """The outputs-streamed target: trajectories streamed with the progress outputs,
    part after part, across preemptions, join to each final trajectory bit for bit."""
    required = {"output: a streamed trajectory joined to the final one": 50}
    passes_and_reaches(harness_for("outputs-streamed", "step"), OUTPUTS_EXAMPLES, required)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_front_returns_latents_and_trajectories_as_the_oracle(mode: str) -> None:
    """The outputs-front target: single requests' and grouped prompts' latents and
    trajectories through the engine's front equal the oracle's, prompt by prompt."""
    machine = harness_for("outputs-front", mode)
    passes_and_reaches(machine, OUTPUTS_FRONT_EXAMPLES, REQUIRED_REACH[f"outputs-front-{mode}"])


@pytest.mark.slow
@pytest.mark.parametrize("target", ["outputs-mp", "outputs-stage"])
def test_latents_and_trajectories_cross_mp_and_the_stage_as_the_oracle(target: str) -> None:
    """The outputs targets over mp workers and across the stage's socket (slow: a
    worker group or a stage process per example)."""
    machine = harness_for(target, "step")
    passes(machine, MP_EXAMPLES)
    print(machine.reach.table())
    assert not machine.reach.missing({"output: a trajectory (full)": 5}), machine.reach.table()


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize("target", ["core", "front", "lockstep"])
def test_the_real_runtime_passes_and_reaches_every_path(target: str, mode: str) -> None:
    required = dict(REQUIRED_REACH[target])
    if target == "core" and mode == "step":
        required.update(REQUIRED_REACH["step"])
    examples = LOCKSTEP_EXAMPLES if target == "lockstep" else MAX_EXAMPLES
    passes_and_reaches(harness_for(target, mode), examples, required)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_real_runtime_passes_with_adapters_and_reaches_every_path(mode: str) -> None:
    required = dict(REQUIRED_REACH["lora"])
    if mode == "step":
        required.update(REQUIRED_REACH["lora-step"])
    passes_and_reaches(lora_harness(mode), LORA_EXAMPLES, required)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_real_runtime_passes_with_a_step_cache_and_reaches_every_path(mode: str) -> None:
    """The cache target: requests that reuse cached model outputs (batched, and in
    step mode preempted and offloaded) equal the oracle, which runs each alone."""
    required = dict(REQUIRED_REACH["cache"])
    if mode == "step":
        required.update(REQUIRED_REACH["cache-step"])
    passes_and_reaches(cache_harness(mode), CACHE_EXAMPLES, required)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_first_block_cache_on_a_dit_passes_and_reaches_every_path(mode: str) -> None:
    """The cache-dit target: requests whose first-block cache skipped later blocks
    (batched, and in step mode preempted and offloaded) equal the oracle's."""
    pytest.importorskip("diffusers")
    required = {"path: a request reused cached model outputs as the oracle": 10}
    if mode == "step":
        required["path: a preempted request reused cached outputs"] = 1
    passes_and_reaches(harness_for("cache-dit", mode), CACHE_DIT_EXAMPLES, required)


@pytest.mark.slow
def test_the_step_cache_over_mp_workers_passes_and_reaches_every_path() -> None:
    """The cache-mp target (slow: a worker group per example)."""
    required = {"path: a request reused cached model outputs as the oracle": 10}
    passes_and_reaches(harness_for("cache-mp", "step"), CACHE_MP_EXAMPLES, required)


def test_the_real_runtime_passes_with_preemption_and_reaches_every_path() -> None:
    passes_and_reaches(preempt_harness(), MAX_EXAMPLES, REQUIRED_REACH["preempt"])


def test_a_users_preempting_scheduler_preempts_under_the_default_rules() -> None:
    passes_and_reaches(user_scheduler_harness(), MAX_EXAMPLES, REQUIRED_REACH["user-scheduler"])


@pytest.mark.parametrize(
    ("policy", "miss"),
    [("slo", "drop"), ("slo", "run_late"), ("edf", "drop"), ("priority", "drop")],
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
def test_the_real_runtime_passes_cfg_parallel_as_the_degree_1_oracle(mode: str) -> None:
    passes_and_reaches(
        harness_for("cfg-parallel", mode), CFG_PARALLEL_EXAMPLES, REQUIRED_REACH["parallel"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("target,mode", [("ulysses", "step"), ("ring", "request")])
def test_the_real_runtime_passes_the_sequence_split_within_rounding(target: str, mode: str) -> None:
    passes_and_reaches(
        harness_for(target, mode), SEQUENCE_PARALLEL_EXAMPLES, REQUIRED_REACH["parallel"]
    )


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
    caught = hunt(mutation, max_examples=examples)
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
