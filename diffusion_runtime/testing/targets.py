"""The harness targets a mutation names, resolved by name: each builds its
harness class for an execution mode over the ``testing-faults`` pipeline.

:func:`harness_for` is what :func:`~diffusion_runtime.testing.mutations.hunt`
and a replay file's ``target`` recipe use; the factories are public, to run a
target in another configuration.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from typing import Any

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineCore
from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.executor.mp import MultiprocExecutor
from diffusion_runtime.sampling_params import SamplingParams
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
from diffusion_runtime.testing.lora_rules import adapter_lifecycle_machine, digits_adapter_pool
from diffusion_runtime.testing.stage_front import StageFront
from diffusion_runtime.testing.strategies import sampling_params

PROMPTS = st.sampled_from(["cat", "dog", 7])
DIGIT_PROMPTS = st.sampled_from([3, "7", 0])
DIT_PROMPTS = st.sampled_from([3, 7, 0])
#: Prompts ``testing-faults`` fails on: in the forward, by a missing result, in a step.
FAILING_PROMPTS = st.sampled_from(["fail", "missing", "bad-step"])
#: RPC timeouts: on mp a microsecond is too short for any reply (the late one must be dropped).
RPC_TIMEOUTS = st.sampled_from([1e-6, None, 5.0])


def params(
    mode: str,
    priorities: tuple[int, int] = (0, 0),
    deadline_s: st.SearchStrategy[float | None] | None = None,
) -> st.SearchStrategy[SamplingParams]:
    """Sampling parameters for ``mode``: step mode's requests stay running long
    enough to be aborted mid-flight."""
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
    """The core targets' engine config (``more``: other config fields). The pipeline
    has weights, so that a level-2 sleep drops and reloads some."""
    return EngineConfig(
        pipeline="testing-faults",
        pipeline_kwargs={"weights": True},
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
    """The core harness over the ``backend`` executor (targets ``core`` and ``mp``)."""
    return core_lifecycle_machine(
        lambda: config(mode, backend),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        fatal_prompts=st.just("device-fault") if backend == "uni" else None,
        # Half the examples step through step_batch and post_decode_batch (step mode).
        pipeline_options=st.fixed_dictionaries({"batched_steps": st.sampled_from([True, False])}),
        params=params(mode),
        rpc_timeouts=RPC_TIMEOUTS,
    )


def preempt_harness() -> type[CoreLifecycleMachine]:
    """The step-mode core under the preemptive priority policy, priorities drawn per
    request: a better-ranked arrival preempts a running request, which resumes later.
    The offload budget holds about two preempted states, so some resume from host
    memory and some from the device."""
    return core_lifecycle_machine(
        lambda: config("step", policy="priority", preempted_offload_bytes=16 * 2**10),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        fatal_prompts=st.just("device-fault"),
        params=params("step", priorities=(0, 3)),
        rpc_timeouts=RPC_TIMEOUTS,
    )


def output_params(
    mode: str, priorities: tuple[int, int] = (0, 0), streams: bool = False
) -> st.SearchStrategy[SamplingParams]:
    """Sampling parameters with output options drawn per request: latents,
    trajectories, stochastic steps with log-probabilities, custom timesteps (and
    with ``streams``, trajectories streamed with the progress outputs)."""
    return sampling_params(
        steps=(1, 3) if mode == "request" else (2, 6),
        outputs=(1, 2),
        guidance=[1.0, 2.0],
        priorities=priorities,
        output_options=True,
        schedules=True,
        stream_trajectories=streams,
    )


def outputs_harness(
    mode: str, backend: str = "uni", streams: bool = False
) -> type[CoreLifecycleMachine]:
    """The core harness over ``backend`` with output options drawn per request
    (:func:`output_params`): in step mode under the preemptive priority policy
    with host offload, so trajectories resume mid-way; in request mode in
    batched waves. ``streams`` (step mode, whose engine streams progress) draws
    ``stream_trajectory`` too."""
    policy, offload = ("priority", 16 * 2**10) if mode == "step" else ("fifo", 0)
    priorities = (0, 3) if mode == "step" else (0, 0)
    return core_lifecycle_machine(
        lambda: config(mode, backend, policy=policy, preempted_offload_bytes=offload),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        pipeline_options=st.fixed_dictionaries({"batched_steps": st.sampled_from([True, False])}),
        params=output_params(mode, priorities, streams),
    )


def user_scheduler_harness() -> type[CoreLifecycleMachine]:
    """The default core harness (no priority drawn) with a user's scheduler that
    preempts on priority: its own rules must make it preempt."""
    return core_lifecycle_machine(
        lambda: config("step"),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
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
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        fatal_prompts=st.just("device-fault"),
        params=params(mode, priorities=(0, 3), deadline_s=tick_deadlines()),
        rpc_timeouts=RPC_TIMEOUTS,
        base=DeadlineCoreLifecycleMachine,
    )


def patient_harness() -> type[CoreLifecycleMachine]:
    """The deadline harness under a policy that reorders but never preempts, with
    room for three: a running set with places free while an aged request of
    another key waits (the aging bound's form without preemption)."""
    return deadline_harness(PatientEarliestDeadline, "run_late", max_num_seqs=3)


def lora_harness(mode: str) -> type[CoreLifecycleMachine]:
    """The core harness with adapters (:mod:`.lora_rules`) over the digits pipeline:
    four adapters in the pool, three host slots and two device slots, so loading
    evicts and steps hold requests back."""
    # At least two steps: the merged-weights oracle's rounding differences grow
    # tenfold when one step predicts the image from pure noise.
    steps = (2, 4) if mode == "request" else (2, 6)
    return adapter_lifecycle_machine(
        lambda: lora_config(mode),
        digits_adapter_pool(),
        sampling_params(steps=steps, outputs=(1, 2), guidance=[1.0, 2.0]),
        prompts=DIGIT_PROMPTS,
        rpc_timeouts=RPC_TIMEOUTS,
    )


def lora_config(mode: str) -> EngineConfig:
    """The adapter targets' engine config: the digits pipeline, one thread."""
    return EngineConfig(
        pipeline="digits",
        device="cpu",
        max_num_seqs=3,
        execution_mode=mode,
        streaming_output=mode == "step",
        preview_interval=1,
        max_loras=2,
        max_cpu_loras=3,
        warmup=False,
        intra_op_threads=1,
    )


def cache_harness(mode: str, backend: str = "uni", dit: bool = False) -> type[CoreLifecycleMachine]:
    """The core harness over ``backend`` and the digits pipeline with a step cache
    (TeaCache), or with ``dit`` over a tiny diffusers DiT with the first-block
    cache, the cache settings drawn per request: in step mode under the preemptive
    priority policy with host offload, so cached outputs resume mid-way; in
    request mode in batched waves. At least three steps, so that a step between
    the first and the last can reuse an output."""
    step = mode == "step"
    return core_lifecycle_machine(
        lambda: cache_dit_config(mode) if dit else cache_config(mode, backend),
        prompts=DIT_PROMPTS if dit else DIGIT_PROMPTS,
        params=sampling_params(
            steps=(3, 8),
            outputs=(1, 2),
            guidance=[1.0, 2.0],
            priorities=(0, 3) if step else (0, 0),
            caches=True,
        ),
        rpc_timeouts=RPC_TIMEOUTS,
    )


def cache_config(mode: str, backend: str = "uni") -> EngineConfig:
    """The cache target's engine config: digits with TeaCache at 0.3, one thread."""
    step = mode == "step"
    return EngineConfig(
        pipeline="digits",
        device="cpu",
        max_num_seqs=3,
        execution_mode=mode,
        executor_backend=backend,
        streaming_output=step,
        preview_interval=1,
        scheduling_policy="priority" if step else "fifo",
        preempted_offload_bytes=16 * 2**10 if step else 0,
        cache_backend="tea_cache",
        cache_config={"rel_l1_thresh": 0.3},
        warmup=False,
        intra_op_threads=1,
    )


def cache_dit_config(mode: str) -> EngineConfig:
    """The ``cache-dit`` target's engine config: a tiny diffusers DiT (built once per
    process) in fixed chunks of 4 rows, with the first-block cache at 0.3."""
    return attrs.evolve(
        cache_config(mode),
        pipeline=_tiny_dit_adapter,
        cache_backend="first_block",
    )


def _tiny_dit_adapter(device: Any) -> Any:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    return DiffusersPipeline(_tiny_dit(), device, rows_per_call=4)


@functools.cache
def _tiny_dit() -> Any:
    """The random-weight DiT, built once per process (its weights never change)."""
    from diffusion_runtime.pipelines.diffusers.tiny import tiny_dit

    return tiny_dit(latent_size=8)


def cfg_parallel_config(mode: str) -> EngineConfig:
    """The ``cfg-parallel`` target's engine config: digits on two mp ranks that
    split guidance branches (a worker group starts per example)."""
    return EngineConfig(
        pipeline="digits",
        device="cpu",
        max_num_seqs=3,
        execution_mode=mode,
        cfg_parallel_size=2,
        warmup=False,
        worker_start_timeout_s=120.0,
    )


def kill_rank_one(core: EngineCore) -> None:
    """Kill worker rank 1 of an mp engine: the next collective of its peer fails
    (or the executor's death monitor sees it first), and the engine dies."""
    executor = core.executor
    assert isinstance(executor, MultiprocExecutor), "rank 1 is killed in mp engines only"
    os.kill(executor.worker_pids[1], signal.SIGKILL)


def cfg_parallel_harness(mode: str) -> type[CoreLifecycleMachine]:
    """The core harness over CFG-parallel digits, held bit for bit to the direct
    oracle, which runs the pipeline in this process with every degree at 1; its
    fault rule kills rank 1."""
    return core_lifecycle_machine(
        lambda: cfg_parallel_config(mode),
        prompts=DIGIT_PROMPTS,
        params=sampling_params(steps=(2, 4), outputs=(1, 2), guidance=[1.0, 2.0]),
        worker_killer=kill_rank_one,
    )


def sequence_parallel_config(mode: str, degree: str) -> EngineConfig:
    """The ``ulysses`` and ``ring`` targets' engine config: the tiny DiT in chunks
    of 4 rows on two mp ranks that split every row's tokens by ``degree``."""
    degrees: dict[str, Any] = {degree: 2}
    return EngineConfig(
        pipeline=_tiny_dit_adapter,
        device="cpu",
        max_num_seqs=3,
        execution_mode=mode,
        warmup=False,
        intra_op_threads=1,
        worker_start_timeout_s=120.0,
        **degrees,
    )


#: How far a split DiT's pixels may be from one rank's: the ring merges partial
#: softmaxes in another order than one rank's attention (up to about 1.2e-5 seen over 10 steps).
SEQUENCE_TOLERANCE = 1e-4


def sequence_parallel_harness(mode: str, degree: str) -> type[CoreLifecycleMachine]:
    """The core harness over the tiny DiT split by ``degree`` (``ulysses_degree``
    or ``ring_degree``) over two mp ranks, held to the direct oracle with every
    degree at 1 within :data:`SEQUENCE_TOLERANCE`; its fault rule kills rank 1."""
    return core_lifecycle_machine(
        lambda: sequence_parallel_config(mode, degree),
        prompts=DIT_PROMPTS,
        params=sampling_params(steps=(2, 3), outputs=(1, 2), guidance=[1.0, 2.0]),
        oracle_tolerance=SEQUENCE_TOLERANCE,
        worker_killer=kill_rank_one,
    )


def front_harness(mode: str) -> type[EngineLifecycleMachine]:
    """The front harness over a :class:`~diffusion_runtime.engine.DiffusionEngine`."""
    return lifecycle_machine(
        lambda: front_config(mode),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        params=params(mode),
        read_timeout_s=3.0,  # a hung stream fails the example instead of the suite
    )


def front_config(mode: str) -> EngineConfig:
    """The front and lockstep targets' engine config."""
    return EngineConfig(
        pipeline="testing-faults", device="cpu", max_num_seqs=3, execution_mode=mode
    )


def stage_harness(mode: str) -> type[EngineLifecycleMachine]:
    """The front harness over a stage client and its stage process."""
    return lifecycle_machine(
        lambda: stage_config(mode),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        params=params(mode),
        read_timeout_s=3.0,  # a hung stream fails the example instead of the suite
        front=StageFront,
    )


def front_outputs_harness(mode: str, front: str = "engine") -> type[EngineLifecycleMachine]:
    """The front target (``front="engine"``) or the stage target (``"stage"``) with
    output options drawn per request (:func:`output_params`): latents,
    trajectories and log-probabilities of single requests and of grouped prompts,
    through the engine's front or across the stage's socket."""
    on_stage = front == "stage"
    return lifecycle_machine(
        (lambda: stage_config(mode)) if on_stage else (lambda: front_config(mode)),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        params=output_params(mode),
        read_timeout_s=3.0,  # a hung stream fails the example instead of the suite
        front=StageFront if on_stage else None,
    )


def stage_config(mode: str) -> EngineConfig:
    """The stage target's engine config: a stage starts per example."""
    return EngineConfig(
        pipeline="testing-faults",
        device="cpu",
        max_num_seqs=3,
        execution_mode=mode,
        warmup=False,
        intra_op_threads=1,
    )


def lockstep_harness(mode: str) -> type[EngineLifecycleMachine]:
    """The lockstep harness: an engine the harness drives itself, racing its loop."""
    return lockstep_machine(
        lambda: front_config(mode),
        prompts=PROMPTS,
        failing_prompts=FAILING_PROMPTS,
        params=params(mode),
        read_timeout_s=3.0,  # a hung stream fails the example instead of the suite
    )


#: Each target's harness class for an execution mode: ``core`` (an EngineCore,
#: uni), ``mp`` (an EngineCore over the mp executor), ``preempt`` (an EngineCore
#: under a preemptive policy), ``deadline-drop``/``deadline-run_late`` (an
#: EngineCore on a virtual clock under the ``slo`` policy with that
#: ``deadline_miss``), ``deadline-patient`` (the same under
#: ``PatientEarliestDeadline``, which does not preempt), ``front`` (a
#: DiffusionEngine), ``lockstep`` (a DiffusionEngine the harness drives itself,
#: racing its loop), ``stage`` (a StageClient and its stage process) and
#: ``user-scheduler`` (an EngineCore with a user's preempting ``scheduler_cls``,
#: under the default core harness), ``lora`` (an EngineCore with LoRA adapters
#: over the digits pipeline), ``outputs`` (an EngineCore serving latents and
#: trajectories, preempting in step mode), ``outputs-mp`` (the same over the mp
#: executor), ``outputs-streamed`` (the same in step mode, trajectories streamed
#: with the progress outputs), ``outputs-front`` and ``outputs-stage`` (the front
#: and stage targets with output options drawn), ``cache`` (an EngineCore over the
#: digits pipeline with a step cache, cache settings drawn per request),
#: ``cache-mp`` (the same over the mp executor), ``cache-dit`` (the same over a
#: tiny diffusers DiT with the first-block cache),
#: ``cfg-parallel`` (an EngineCore over two mp ranks that split guidance, against
#: the degree-1 oracle), ``ulysses`` and ``ring`` (the same over a tiny DiT whose
#: tokens two mp ranks split, within rounding of the degree-1 oracle).
#: The preemptive and deadline targets
#: run in step mode whatever the mode.
HARNESSES: dict[str, Callable[[str], type[RuleBasedStateMachine]]] = {
    "core": core_harness,
    "mp": lambda mode: core_harness(mode, "mp"),
    "preempt": lambda mode: preempt_harness(),
    "user-scheduler": lambda mode: user_scheduler_harness(),
    "deadline-drop": lambda mode: deadline_harness("slo", "drop"),
    "deadline-run_late": lambda mode: deadline_harness("slo", "run_late"),
    "deadline-edf": lambda mode: deadline_harness("edf", "drop"),
    "deadline-priority": lambda mode: deadline_harness("priority", "drop"),
    "deadline-patient": lambda mode: patient_harness(),
    "front": front_harness,
    "lockstep": lockstep_harness,
    "stage": stage_harness,
    "lora": lora_harness,
    "outputs": outputs_harness,
    "outputs-mp": lambda mode: outputs_harness(mode, "mp"),
    "outputs-streamed": lambda mode: outputs_harness("step", streams=True),
    "outputs-front": front_outputs_harness,
    "cfg-parallel": cfg_parallel_harness,
    "ulysses": lambda mode: sequence_parallel_harness(mode, "ulysses_degree"),
    "ring": lambda mode: sequence_parallel_harness(mode, "ring_degree"),
    "outputs-stage": lambda mode: front_outputs_harness(mode, "stage"),
    "cache": cache_harness,
    "cache-mp": lambda mode: cache_harness(mode, "mp"),
    "cache-dit": lambda mode: cache_harness(mode, dit=True),
}


def harness_for(target: str, mode: str) -> type[RuleBasedStateMachine]:
    """A fresh harness class of ``target`` (a key of :data:`HARNESSES`) in ``mode``."""
    factory = HARNESSES.get(target)
    if factory is None:
        raise InvalidFieldError(
            "harness_for", "target", f"must be one of {sorted(HARNESSES)}", target
        )
    return factory(mode)
