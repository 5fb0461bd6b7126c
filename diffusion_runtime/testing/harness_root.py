"""The root of every lifecycle harness: what the core harness (an
:class:`~diffusion_runtime.core.EngineCore` stepped by the test) and the
front harnesses (an engine, the lockstep engine, a stage) share.

:class:`HarnessRoot` holds the configuration every harness takes, the
auditor fed with every event, the admission and terminal counts, the direct
oracle, and the checks they all make: the auditor finds nothing after every
rule; nothing is held for a finished request; every admission ends in one
terminal state and the trace ends with the engine closing (or dying); a
completed output has the images asked for, equal to the pipeline's own
output for that request (called directly, outside the engine), and another
seed gives other images. :func:`configured` builds a configured harness
class from any root subclass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, ClassVar, TypeVar

import hypothesis.strategies as st
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineSnapshot
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.fsm import TERMINAL_STATES, LifecycleEvent
from diffusion_runtime.fsm.audit import Auditor
from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.outputs import RequestOutput, Trajectory
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.testing.oracle import DirectOracle
from diffusion_runtime.testing.reach import Reach
from diffusion_runtime.testing.strategies import sampling_params
from diffusion_runtime.trajectory import SampledOutput, TrajectoryTensors

#: How many seed-dependence checks one example makes (each is two direct forwards).
SEED_CHECKS_PER_EXAMPLE = 2

Harness = TypeVar("Harness", bound="HarnessRoot")


class HarnessRoot(RuleBasedStateMachine):
    """The shared root: configuration, auditor, oracle and the common checks."""

    config_factory: ClassVar[Callable[[], EngineConfig]]
    prompts: ClassVar[st.SearchStrategy[Any]] = st.sampled_from(["a", "b", 7])
    params: ClassVar[st.SearchStrategy[SamplingParams]] = sampling_params()
    #: Prompts the pipeline is known to fail.
    failing_prompts: ClassVar[st.SearchStrategy[Any] | None] = None
    scheduler_cls: ClassVar[type[BaseScheduler] | None] = None
    executor_cls: ClassVar[type[DiffusionExecutor] | None] = None
    #: The absolute difference allowed between an output and the direct run.
    oracle_tolerance: ClassVar[float] = 0.0
    reach: ClassVar[Reach] = Reach()
    #: The engine's configuration (set by each harness once it has built its engine).
    config: EngineConfig

    def __init__(self) -> None:
        super().__init__()
        self.auditor = Auditor()
        #: Admissions and terminal states per id, as the trace told them.
        self.admissions: dict[str, int] = {}
        self.terminals: dict[str, int] = {}
        self.seed_checks = 0

    @functools.cached_property
    def oracle(self) -> DirectOracle:
        """The pipeline built as a worker of :attr:`config` builds it, called directly
        (built on first use)."""
        return DirectOracle.for_config(self.config)

    @invariant()
    def the_auditor_finds_nothing(self) -> None:
        assert not self.auditor.violations, self.auditor.violations[0].describe()

    def _record(self, event: TraceEvent) -> None:
        """Feed the auditor and count admissions and terminal states."""
        self.auditor.feed(event)
        if isinstance(event, LifecycleEvent) and not event.rejected:
            rid = event.request_id
            if event.source is None:
                self.admissions[rid] = self.admissions.get(rid, 0) + 1
            elif event.dest in TERMINAL_STATES:
                self.terminals[rid] = self.terminals.get(rid, 0) + 1

    # -- checks ------------------------------------------------------------------------

    @staticmethod
    def check_nothing_held(
        snapshot: EngineSnapshot, finished: set[str], preempted: Collection[str], step_mode: bool
    ) -> None:
        """No scheduler or runner state for a finished request; in step mode every
        running request has runner state, and only running or preempted ones do."""
        for part in ("scheduler_ids", "runner_cached_ids"):
            held = getattr(snapshot, part) & finished
            assert not held, f"{part} holds finished requests {sorted(held)}"
        if step_mode:
            assert snapshot.running_ids <= snapshot.runner_cached_ids, snapshot
            assert snapshot.runner_cached_ids <= snapshot.running_ids | set(preempted), snapshot

    def check_trace_ended(self, *, may_have_died: bool) -> None:
        """Every admission ended in exactly one terminal state, the trace ended with
        the engine closing (or, where it may have, dying), and the auditor found nothing."""
        for rid, admitted in self.admissions.items():
            assert self.terminals.get(rid, 0) == admitted, (
                f"{rid!r}: {admitted} admissions, {self.terminals.get(rid, 0)} terminal states"
            )
        self.auditor.finish()
        assert self.auditor.complete or (may_have_died and self.auditor.dead), (
            "the trace did not end with the engine closing (or dying, after a fault)"
        )
        assert not self.auditor.violations, self.auditor.violations[0].describe()

    @staticmethod
    def check_image_count(output: RequestOutput, params: SamplingParams) -> None:
        """A completed output has the images (or latents) its request asked for."""
        count = params.num_outputs_per_prompt
        produced = output.image_batch if params.decodes else output.latents
        got = None if produced is None else tuple(produced.shape)
        what = "images" if params.decodes else "latents"
        assert produced is not None and produced.shape[0] == count, (
            f"{output.request_id!r} completed with {what} {got}; it asked for {count}"
        )

    def expected_output(
        self, prompt: Any, params: SamplingParams, seed: int
    ) -> torch.Tensor | SampledOutput | None:
        """The pipeline's own output for a request, run directly now: its images, or
        with what it asked for besides (``None``: the pipeline alone fails it)."""
        if params.decodes and not params.return_trajectory:
            return self.oracle.images(prompt, params, seed)
        return self.oracle.sampled(prompt, params, seed)

    def check_against_the_pipeline(
        self, output: RequestOutput, prompt: Any, params: SamplingParams, seed: int
    ) -> None:
        """A completed output equals the pipeline's own output, called directly now,
        and another seed gives other images."""
        self.check_against_expected(
            output, prompt, params, seed, self.expected_output(prompt, params, seed)
        )
        if not self.oracle.seed_free and self.seed_checks < SEED_CHECKS_PER_EXAMPLE:
            self.seed_checks += 1
            other = _main_tensor(self.expected_output(prompt, params, seed + 1))
            mine = output.image_batch if params.decodes else output.latents
            assert mine is not None
            assert other is None or not torch.equal(other, mine), (
                f"the pipeline ignores the seed: prompt {prompt!r} gave equal "
                f"images with seeds {seed} and {seed + 1} "
                "(declare seed_free = True on a pipeline that means to)"
            )

    def tolerance_for(self, params: SamplingParams) -> float:
        """The absolute difference allowed between a request's output and the direct run."""
        return self.oracle_tolerance

    def check_against_expected(
        self,
        output: RequestOutput,
        prompt: Any,
        params: SamplingParams,
        seed: int,
        expected: torch.Tensor | SampledOutput | None,
    ) -> None:
        """A completed output equals ``expected``, the pipeline's own output for its
        request (``None``: the pipeline alone failed it): its images or latents, as
        it asked, and its trajectory when it asked for one."""
        rid = output.request_id
        assert expected is not None, (
            f"{rid!r} completed, but the pipeline alone fails prompt {prompt!r}"
        )
        produced, other = (output.image_batch, output.latents)
        if not params.decodes:
            produced, other = other, produced
        assert produced is not None and other is None, (
            f"{rid!r} asked for output_type {params.output_type!r}; it got "
            f"images {output.image_batch is not None}, latents {output.latents is not None}"
        )
        tolerance = self.tolerance_for(params)
        where = f"(prompt {prompt!r}, {params}, seed {seed})"
        want = _main_tensor(expected)
        assert want is not None and self.oracle.matches(want, produced, tolerance), (
            f"{rid!r}: output differs from the pipeline run directly {where}"
        )
        sampled = expected if isinstance(expected, SampledOutput) else None
        wanted = None if sampled is None else sampled.trajectory
        got = output.trajectory
        assert (got is None) == (wanted is None), (
            f"{rid!r}: return_trajectory is {params.return_trajectory!r}, yet its output "
            f"{'has no' if got is None else 'has a'} trajectory"
        )
        if not params.decodes:
            self.reach.note("output: latents")
        if params.timesteps is not None:
            self.reach.note("output: custom timesteps")
        if got is None or wanted is None:
            return
        self.reach.note(f"output: a trajectory ({params.return_trajectory})")
        if got.log_probs is not None:
            self.reach.note("output: log-probabilities of stochastic steps")
        self.check_same_trajectory(
            got, wanted, tolerance, f"{rid!r}: trajectory", f"the direct run's {where}"
        )

    def check_same_trajectory(
        self,
        got: Trajectory | TrajectoryTensors,
        wanted: Trajectory | TrajectoryTensors,
        tolerance: float,
        what: str,
        theirs: str,
    ) -> None:
        """``got`` has ``wanted``'s timesteps and log-prob steps, and its latents and
        log-probabilities within ``tolerance``; a failure says ``what`` differs
        from ``theirs``."""
        steps = (got.timesteps, got.log_prob_steps)
        assert steps == (wanted.timesteps, wanted.log_prob_steps), (
            f"{what} timesteps and log-prob steps {steps} differ from "
            f"{theirs} {(wanted.timesteps, wanted.log_prob_steps)}"
        )
        assert self.oracle.matches(wanted.latents, got.latents, tolerance), (
            f"{what} latents differ from {theirs}"
        )
        log_probs = (wanted.log_probs, got.log_probs)
        assert (log_probs[0] is None) == (log_probs[1] is None) and (
            log_probs[0] is None
            or log_probs[1] is None
            or self.oracle.matches(log_probs[0], log_probs[1], tolerance)
        ), f"{what} log-probabilities differ from {theirs}"


def _main_tensor(expected: torch.Tensor | SampledOutput | None) -> torch.Tensor | None:
    """The images (or latents) of an expected output."""
    return expected.output if isinstance(expected, SampledOutput) else expected


def configured(
    base: type[Harness], name: str, config: Callable[[], EngineConfig], **options: Any
) -> type[Harness]:
    """A subclass of ``base`` building engines from ``config()``, with ``options`` as
    class attributes (an option left ``None`` keeps the class's default) and a
    :class:`Reach` of its own."""
    attributes: dict[str, Any] = {"config_factory": staticmethod(config), "reach": Reach()}
    attributes.update((key, value) for key, value in options.items() if value is not None)
    return type(name, (base,), attributes)
