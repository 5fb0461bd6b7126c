"""Batch requests: a parent in the client with one real request per prompt in the core.

The parent has a lifecycle of its own, in a
:class:`~diffusion_runtime.fsm.RequestMachine` (the same table as every
request): admitted ``WAITING``, ``RUNNING`` once the stage admitted its
children. Its children's final outputs fire its triggers by one rule,
:data:`CHILD_END_TRIGGERS`, while it runs:

============================  ==============================================
a child ends                  the running parent
============================  ==============================================
``FINISHED_ERROR``            ``fail``, reason ``"prompt <i>: <error>"``
``FINISHED_ABORTED``          ``abort``, reason ``"prompt <i>: <reason>"``
``FINISHED_COMPLETED``        ``complete``, once every child has completed
============================  ==============================================

A caller's abort of the parent fires ``abort``; the stage dying fails it. A
finished parent ignores its children's later ends; the front's terminal hook
aborts the children still running. The parent's final output is built once
every child has ended, from the parent's state and the reason of its
terminal transition, so no status is decided outside the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from diffusion_runtime.errors import describe_error
from diffusion_runtime.fsm import RequestLifecycle, RequestMachine, RequestStatus, Trigger
from diffusion_runtime.outputs import STAGES, RequestMetrics, RequestOutput

#: What a child's final status fires on its running parent (``complete`` only
#: when it is the last child to end).
CHILD_END_TRIGGERS: dict[RequestStatus, Trigger] = {
    RequestStatus.FINISHED_ERROR: Trigger.FAIL,
    RequestStatus.FINISHED_ABORTED: Trigger.ABORT,
    RequestStatus.FINISHED_COMPLETED: Trigger.COMPLETE,
}


def child_request_id(batch_id: str, index: int) -> str:
    """The id of prompt ``index`` of batch ``batch_id`` in the core."""
    return f"{batch_id}/{index}"


class BatchRequest(RequestLifecycle):
    """A batch request's parent, and the output sink of all its children
    (``child_ids``, in prompt order). Created admitted, in ``WAITING``.

    ``result`` resolves to the parent's one final output, or to the error that
    ended the stage or the client.
    """

    __slots__ = ("_ended", "_finals", "_index", "_machine", "child_ids", "reason", "result", "seed")

    def __init__(
        self,
        request_id: str,
        child_ids: list[str],
        seed: int,
        machine: RequestMachine[BatchRequest],
        result: asyncio.Future[RequestOutput],
    ) -> None:
        super().__init__(request_id)
        self.child_ids = child_ids
        self.seed = seed
        self.result = result
        self.reason: str | None = None
        self._machine = machine
        self._index = {child_id: i for i, child_id in enumerate(child_ids)}
        self._finals: list[RequestOutput | None] = [None] * len(child_ids)
        self._ended = 0
        machine.admit(self)

    @property
    def live_child_ids(self) -> list[str]:
        """Children whose final output has not arrived."""
        return [
            cid for cid, final in zip(self.child_ids, self._finals, strict=True) if final is None
        ]

    def start(self) -> None:
        """The stage admitted every child."""
        if self.state is RequestStatus.WAITING:
            self._fire(Trigger.SCHEDULE, None)

    def abort(self, reason: str) -> None:
        """The caller's abort (a no-op once the parent has finished)."""
        event = self._machine.abort_if_active(self, reason)
        if event is not None:
            self.reason = event.reason
        self._deliver_when_done()

    # -- the sink of the children's outputs ---------------------------------------------

    def push(self, output: RequestOutput) -> None:
        if not output.finished:  # a batch streams nothing but its final output
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
        """The stage or the client ended before the children did (or refused them)."""
        if not self.is_finished:
            self._fire(Trigger.FAIL, describe_error(error))
        if not self.result.done():
            self.result.set_exception(error)

    # -- internals -----------------------------------------------------------------------

    def _fire(self, trigger: Trigger, reason: str | None) -> None:
        self.reason = self._machine.fire(self, trigger, reason=reason).reason

    def _deliver_when_done(self) -> None:
        if self.is_finished and self._ended == len(self.child_ids) and not self.result.done():
            self.result.set_result(self._final_output())

    def _final_output(self) -> RequestOutput:
        """Every prompt's images in prompt order if the parent completed, else none;
        each metric is the slowest child's and ``step`` the least progress."""
        finals = [final for final in self._finals if final is not None]
        completed = self.state is RequestStatus.FINISHED_COMPLETED
        batches = [o.image_batch for o in finals if o.image_batch is not None]
        steps = [o.step for o in finals]
        return RequestOutput(
            request_id=self.request_id,
            status=self.state,
            finished=True,
            image_batch=torch.cat(batches) if completed and batches else None,
            seed=self.seed,
            error=None if completed else self.reason,
            metrics=_slowest([o.metrics for o in finals]),
            step=None if None in steps else min(s for s in steps if s is not None),
            num_steps=finals[0].num_steps,
        )


def _slowest(metrics: Sequence[RequestMetrics | None]) -> RequestMetrics | None:
    known = [m for m in metrics if m is not None]
    if not known:
        return None
    peaks = [m.peak_memory_mb for m in known if m.peak_memory_mb is not None]
    return RequestMetrics(
        queue_time_s=max(m.queue_time_s for m in known),
        execution_time_s=max(m.execution_time_s for m in known),
        total_time_s=max(m.total_time_s for m in known),
        stage_durations={
            stage: max(m.stage_durations.get(stage, 0.0) for m in known)
            for stage in STAGES
            if any(stage in m.stage_durations for m in known)
        },
        peak_memory_mb=max(peaks, default=None),
    )
