"""The core harness under a preemptive scheduling policy.

:class:`PreemptiveCoreLifecycleMachine` adds rules that make preemption
happen between rules rather than only while the harness drains the engine at
the end: a full wave of better-ranked requests arrives while others run (and
a step lets it preempt them), and a preempted request is aborted. Everything
the core harness checks applies to preempted requests too: a request that was preempted and
resumed must still equal the direct pipeline's output, and one that ends while
preempted (abort, close, death) must leave nothing held.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.sampling_params import MAX_PRIORITY, SamplingParams
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine


class PreemptiveCoreLifecycleMachine(CoreLifecycleMachine):
    """The core harness with rules that reach preemption; pass it as ``base=`` to
    :func:`~diffusion_runtime.testing.core_harness.core_lifecycle_machine` with a
    config whose ``scheduling_policy`` is preemptive (``priority``, ``edf``, ``slo``)."""

    @precondition(lambda self: self._alive and any(map(self._is_active, self.records)))
    @rule(data=st.data())
    def add_better_ranked(self, data: st.DataObject) -> None:
        """A step (so requests run), then a full wave of requests that outrank every
        active one arrives, and a step lets them preempt every running request.
        They take as many steps as the longest active one, so the preempted ones
        stay preempted for a while."""
        self._add_a_wave_between_steps(
            data,
            lambda drawn, active: attrs.evolve(
                drawn,
                priority=max(min(p.priority for p in active) - 1, -MAX_PRIORITY),
                num_inference_steps=max(p.num_inference_steps for p in active),
            ),
        )

    def _add_a_wave_between_steps(
        self,
        data: st.DataObject,
        params_for: Callable[[SamplingParams, list[SamplingParams]], SamplingParams],
    ) -> None:
        """A step, then ``max_num_seqs`` requests with ``params_for(drawn params, the
        active requests' params)``, then a step (nothing is added once all have ended)."""
        self._step()
        active = [self.records[rid].params for rid in self.records if self._is_active(rid)]
        if self.dead or not active:
            return
        params = params_for(data.draw(self.params), active)
        for _ in range(self.config.max_num_seqs):
            self._add(data, data.draw(self.prompts), params, failing=False)
        self._step()

    @precondition(lambda self: self._alive and self._ids_in(RequestStatus.PREEMPTED))
    @rule(data=st.data())
    def abort_a_preempted_request(self, data: st.DataObject) -> None:
        preempted = self._ids_in(RequestStatus.PREEMPTED)
        self.abort(data.draw(st.sampled_from(preempted), label="preempted id"))

    def _ids_in(self, state: RequestStatus) -> list[str]:
        return sorted(rid for rid, s in self.states.items() if s is state and rid in self.records)
