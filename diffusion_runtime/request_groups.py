"""Grouped requests: one parent request over a child request per prompt.

Both fronts offer it: the in-process engine (``add_request(prompts=[...])``,
``generate(prompts, params, group=True)``) and the stage client
(``add_batch_request``). Each prompt is a real request in the core,
``<parent id>/<index>``, with its own lifecycle; the parent lives in the
front, with a lifecycle of its own in a
:class:`~diffusion_runtime.fsm.RequestMachine` (the same table as every
request): admitted ``WAITING``, ``RUNNING`` once the core admitted its
children. Its children's final outputs fire its triggers by one rule,
:data:`CHILD_END_TRIGGERS`, while it runs:

============================  ==============================================
a child ends                  the running parent
============================  ==============================================
``FINISHED_ERROR``            ``fail``, reason ``"prompt <i>: <error>"``
``FINISHED_ABORTED``          ``abort``, reason ``"prompt <i>: <reason>"``
``FINISHED_COMPLETED``        ``complete``, once every child has completed
============================  ==============================================

A caller's abort of the parent fires ``abort``; the front's end fails it. A
finished parent ignores its children's later ends; the front's terminal hook
aborts the children still running. The parent's one final output is built
once every child has ended (:func:`merge_outputs`), from the parent's state
and the reason of its terminal transition, so no status is decided outside
the machine. A parent streams nothing but that final output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.errors import InvalidFieldError, describe_error
from diffusion_runtime.fsm import RequestLifecycle, RequestMachine, RequestStatus, Trigger
from diffusion_runtime.outputs import RequestMetrics, RequestOutput, Trajectory
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.streams import OutputSink
from diffusion_runtime.validation import bounded_input

#: The most prompts one grouped request may hold.
MAX_GROUP_PROMPTS = 256

#: What a child's final status fires on its running parent (``complete`` only
#: when it is the last child to end).
CHILD_END_TRIGGERS: dict[RequestStatus, Trigger] = {
    RequestStatus.FINISHED_ERROR: Trigger.FAIL,
    RequestStatus.FINISHED_ABORTED: Trigger.ABORT,
    RequestStatus.FINISHED_COMPLETED: Trigger.COMPLETE,
}


def checked_group_prompts(prompts: object) -> list[Any]:
    """A grouped request's prompts as a list: a list or tuple of 1 to
    :data:`MAX_GROUP_PROMPTS` prompts, each within the input bounds; anything
    else is an :class:`~diffusion_runtime.errors.InvalidFieldError` on ``prompts``."""
    if not isinstance(prompts, (list, tuple)):
        rule = f"must be a list or tuple of prompts, not {type(prompts).__name__}"
        raise InvalidFieldError("request", "prompts", rule, prompts)
    if not prompts:
        raise InvalidFieldError("request", "prompts", "must not be empty", prompts)
    if len(prompts) > MAX_GROUP_PROMPTS:
        rule = f"must hold at most {MAX_GROUP_PROMPTS} prompts"
        raise InvalidFieldError("request", "prompts", rule, f"{len(prompts)} prompts")
    bounded_input("request", "prompts", prompts)
    return list(prompts)


def check_group_params(params: SamplingParams) -> None:
    """Refuse, by field, what a grouped request cannot give: it streams no
    progress outputs, so no trajectory parts either."""
    if params.stream_trajectory:
        rule = "is for a single request: a grouped request streams no progress outputs"
        raise InvalidFieldError("SamplingParams", "stream_trajectory", rule, True)


def child_request_id(parent_id: str, index: int) -> str:
    """The id of prompt ``index`` of grouped request ``parent_id`` in the core."""
    return f"{parent_id}/{index}"


class RequestGroup(RequestLifecycle):
    """A grouped request's parent, and the output sink of all its children
    (``child_ids``, in prompt order). Created admitted, in ``WAITING``.

    Its one final output goes to ``sink`` once every child has ended; when the
    front ends first, ``sink`` fails with the front's error. Not thread-safe:
    a front whose callers are on several threads calls it under one lock.
    """

    __slots__ = (
        "_delivered",
        "_ended",
        "_finals",
        "_index",
        "_machine",
        "_sink",
        "child_ids",
        "reason",
        "seed",
    )

    def __init__(
        self,
        request_id: str,
        child_ids: list[str],
        seed: int,
        machine: RequestMachine[RequestGroup],
        sink: OutputSink,
    ) -> None:
        super().__init__(request_id)
        self.child_ids = child_ids
        self.seed = seed
        self.reason: str | None = None
        self._sink = sink
        self._machine = machine
        self._index = {child_id: i for i, child_id in enumerate(child_ids)}
        self._finals: list[RequestOutput | None] = [None] * len(child_ids)
        self._ended = 0
        self._delivered = False
        machine.admit(self)

    @property
    def live_child_ids(self) -> list[str]:
        """Children whose final output has not arrived."""
        return [
            cid for cid, final in zip(self.child_ids, self._finals, strict=True) if final is None
        ]

    @property
    def sink(self) -> OutputSink:
        """Where the parent's final output goes."""
        return self._sink

    @property
    def delivered(self) -> bool:
        """Whether the parent's final output (or the front's error) went to its sink."""
        return self._delivered

    def start(self) -> None:
        """The core admitted every child."""
        if self.state is RequestStatus.WAITING:
            self._fire(Trigger.SCHEDULE, None)

    def abort(self, reason: str) -> bool:
        """The caller's abort; returns whether the parent was active (else a no-op)."""
        event = self._machine.abort_if_active(self, reason)
        if event is not None:
            self.reason = event.reason
        self._deliver_when_done()
        return event is not None

    # -- the sink of the children's outputs ---------------------------------------------

    def push(self, output: RequestOutput) -> None:
        if not output.finished:  # a parent streams nothing but its final output
            return
        index = self._index[output.request_id]
        self._finals[index] = output
        self._ended += 1
        if self.state is RequestStatus.RUNNING:
            trigger = CHILD_END_TRIGGERS[output.status]
            if trigger is not Trigger.COMPLETE:
                self._fire(trigger, f"prompt {index}: {output.error or output.status.value}")
            elif self._ended == len(self.child_ids):
                self._fire(trigger, None)
        self._deliver_when_done()

    def fail(self, error: BaseException) -> None:
        """The front ended before the children did (or refused them)."""
        if not self.is_finished:
            self._fire(Trigger.FAIL, describe_error(error))
        if not self._delivered:
            self._delivered = True
            self._sink.fail(error)

    # -- internals -----------------------------------------------------------------------

    def _fire(self, trigger: Trigger, reason: str | None) -> None:
        self.reason = self._machine.fire(self, trigger, reason=reason).reason

    def _deliver_when_done(self) -> None:
        if self.is_finished and self._ended == len(self.child_ids) and not self._delivered:
            self._delivered = True
            self._sink.push(self._final_output())

    def _final_output(self) -> RequestOutput:
        return merge_outputs(
            self.request_id,
            self.state,
            self.seed,
            self.reason,
            [final for final in self._finals if final is not None],
        )


def merge_outputs(
    request_id: str,
    status: RequestStatus,
    seed: int,
    reason: str | None,
    finals: Sequence[RequestOutput],
) -> RequestOutput:
    """A parent's final output from its children's, in prompt order.

    Completed: the images (``num_outputs_per_prompt`` per prompt), latents and
    trajectories concatenated along the batch dimension ``N``. Otherwise none
    of them, and ``reason`` as the error. Metrics: see :func:`merge_metrics`;
    ``step`` is the least progress among the children.
    """
    completed = status is RequestStatus.FINISHED_COMPLETED
    steps = [o.step for o in finals]
    return RequestOutput(
        request_id=request_id,
        status=status,
        finished=True,
        image_batch=_cat([o.image_batch for o in finals]) if completed else None,
        seed=seed,
        error=None if completed else reason,
        metrics=merge_metrics([o.metrics for o in finals]),
        step=None if None in steps else min(s for s in steps if s is not None),
        num_steps=finals[0].num_steps if finals else None,
        latents=_cat([o.latents for o in finals]) if completed else None,
        trajectory=merge_trajectories([o.trajectory for o in finals]) if completed else None,
    )


def merge_trajectories(trajectories: Sequence[Trajectory | None]) -> Trajectory | None:
    """The children's trajectories as one: latents ``(steps + 1, N, ...)`` and
    log-probabilities ``(len(log_prob_steps), N)`` concatenated along ``N``.
    Children share their params, so they share timesteps and log-prob steps."""
    known = [t for t in trajectories if t is not None]
    if not known:
        return None
    log_probs = [t.log_probs for t in known if t.log_probs is not None]
    return Trajectory(
        latents=torch.cat([t.latents for t in known], dim=1),
        timesteps=known[0].timesteps,
        log_probs=torch.cat(log_probs, dim=1) if len(log_probs) == len(known) else None,
        log_prob_steps=known[0].log_prob_steps,
    )


def merge_metrics(metrics: Sequence[RequestMetrics | None]) -> RequestMetrics | None:
    """A parent's metrics from its children's (admitted together, at one arrival):
    it waited until its first child started (the least queue time), it ended
    when its last child ended (the greatest total time), and it executed in
    between. Its stage durations are the slowest child's (with that queue
    time), its peak memory the highest of any child, and its cached steps and
    model evaluations the sum of its children's."""
    known = [m for m in metrics if m is not None]
    if not known:
        return None
    slowest = max(known, key=lambda m: m.total_time_s)
    queue = min(m.queue_time_s for m in known)
    stages = dict(slowest.stage_durations)
    if stages:
        stages["queue"] = queue
    peaks = [m.peak_memory_mb for m in known if m.peak_memory_mb is not None]
    return attrs.evolve(
        slowest,
        queue_time_s=queue,
        execution_time_s=slowest.total_time_s - queue,
        total_time_s=slowest.total_time_s,
        stage_durations=stages,
        peak_memory_mb=max(peaks, default=None),
        cached_steps=sum(m.cached_steps for m in known),
        model_evaluations=sum(m.model_evaluations for m in known),
    )


def _cat(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    known = [t for t in tensors if t is not None]
    return torch.cat(known) if known else None
