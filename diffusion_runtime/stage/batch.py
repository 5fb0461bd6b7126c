"""How the outputs of a batch request's prompts become its one output."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestMetrics, RequestOutput


def merge_batch(request_id: str, outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One final output for the final outputs of a batch's prompts, in prompt order.

    The batch completes only if every prompt completed: its images are all of
    theirs, concatenated in prompt order. Otherwise it has no images, its
    status is ``FINISHED_ERROR`` if any prompt failed (else ``FINISHED_ABORTED``),
    and its error names each prompt that did not complete, by index, with its
    reason. All prompts share one seed; each metric is the slowest prompt's;
    ``step`` is the least progress among the prompts.
    """
    if not outputs:
        raise ValueError("a batch has at least one prompt")
    unfinished = [(i, o) for i, o in enumerate(outputs) if not o.ok]
    images = None
    if not unfinished:
        batches = [o.image_batch for o in outputs if o.image_batch is not None]
        images = torch.cat(batches) if batches else None
        status = RequestStatus.FINISHED_COMPLETED
    elif any(o.status is RequestStatus.FINISHED_ERROR for _, o in unfinished):
        status = RequestStatus.FINISHED_ERROR
    else:
        status = RequestStatus.FINISHED_ABORTED
    steps = [o.step for o in outputs]
    return RequestOutput(
        request_id=request_id,
        status=status,
        finished=True,
        image_batch=images,
        seed=outputs[0].seed,
        error="; ".join(f"prompt {i}: {o.error or o.status}" for i, o in unfinished) or None,
        metrics=_slowest([o.metrics for o in outputs]),
        step=None if None in steps else min(s for s in steps if s is not None),
        num_steps=outputs[0].num_steps,
    )


def _slowest(metrics: Sequence[RequestMetrics | None]) -> RequestMetrics | None:
    known = [m for m in metrics if m is not None]
    if not known:
        return None
    return RequestMetrics(
        queue_time_s=max(m.queue_time_s for m in known),
        execution_time_s=max(m.execution_time_s for m in known),
        total_time_s=max(m.total_time_s for m in known),
    )
