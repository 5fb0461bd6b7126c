"""Broken stages: bugs in the stage client (this process) and the stage process
(the child). Each is written the way it would slip in; the stage harness
(``lifecycle_test_case(..., target="stage")``) must catch each, and
``docs/auditing.md`` says which check does.

A bug of the child is planted in the child: its patch enters the stage's
entry point (:func:`run_mutated_stage`, named by the mutation and spawned in
place of ``run_stage`` while the mutation is open), never a production path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from diffusion_runtime.fsm import RequestStatus, Trigger
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.request_groups import RequestGroup
from diffusion_runtime.stage import codec
from diffusion_runtime.stage.client import StageClient
from diffusion_runtime.stage.proc import FINAL_LINGER_MS, StageProc, StageSpec, run_stage
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace
from diffusion_runtime.testing.patching import spawn_stages_running

# -- the client (patched in this process) ------------------------------------------------


def end_leaves_streams_open() -> Patch:
    def make(original: Any) -> Any:
        def fail_pending(self: StageClient, error: Exception) -> None:
            # "streams end with their final output; only calls wait on a reply"
            for future in [*self._admissions.values(), *self._calls.values()]:
                if not future.done():
                    future.set_exception(error)
            self._admissions.clear()
            self._calls.clear()

        return fail_pending

    return _replace(StageClient, "_fail_pending", make)


def batch_failed_child_completes() -> Patch:
    def make(original: Any) -> Any:
        def push(self: RequestGroup, output: RequestOutput) -> None:
            if not output.finished:
                return
            index = self._index[output.request_id]
            self._finals[index] = output
            self._ended += 1
            if self.state is RequestStatus.RUNNING:
                if output.status is RequestStatus.FINISHED_ABORTED:
                    self._fire(Trigger.ABORT, f"prompt {index}: {output.error}")
                elif self._ended == len(self.child_ids):  # "a failed prompt has no images"
                    self._fire(Trigger.COMPLETE, None)
            self._deliver_when_done()

        return push

    return _replace(RequestGroup, "push", make)


def batch_abort_through_children() -> Patch:
    def make(original: Any) -> Any:
        def abort(
            self: StageClient,
            request_ids: str | Iterable[str],
            reason: str = "aborted by the caller",
        ) -> None:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            others = []
            for request_id in ids:
                batch = self._batches.get(request_id)
                if batch is None:
                    others.append(request_id)
                elif batch.state is RequestStatus.WAITING:
                    batch.abort(reason)
                else:  # "a running batch is aborted through its prompts: their ends abort it"
                    others.extend(batch.live_child_ids)
            self._send_abort(others, reason)

        return abort

    return _replace(StageClient, "abort", make)


def batch_one_image_per_prompt() -> Patch:
    def make(original: Any) -> Any:
        def final_output(self: RequestGroup) -> RequestOutput:
            output: RequestOutput = original(self)
            finals = [final for final in self._finals if final is not None]
            if output.image_batch is None:
                return output
            # "the batch's images: each prompt's image, in prompt order"
            images = torch.stack([o.image_batch[0] for o in finals if o.image_batch is not None])
            return attrs.evolve(output, image_batch=images)

        return final_output

    return _replace(RequestGroup, "_final_output", make)


# -- the stage process (planted in the child) ----------------------------------------------


def aborted_output_not_sent() -> Patch:
    def make(original: Any) -> Any:
        def send_output(self: StageProc, output: RequestOutput) -> None:
            if output.status is RequestStatus.FINISHED_ABORTED:
                return  # "the client asked for the abort: it knows how the request ended"
            original(self, output)

        return send_output

    return _replace(StageProc, "_send_output", make)


def exit_skips_core_shutdown() -> Patch:
    def make(original: Any) -> Any:
        def close(self: StageProc) -> None:
            # "the process exits right after, and the system takes its memory back"
            self._requests.close(linger=0)
            self._replies.close(linger=FINAL_LINGER_MS)
            if self._guard is not None:
                self._guard.close()
            self._ctx.term()

        return close

    return _replace(StageProc, "_close", make)


def trajectory_at_image_precision() -> Patch:
    def make(original: Any) -> Any:
        def output_tensors(output: RequestOutput) -> dict[str, torch.Tensor | None]:
            tensors: dict[str, torch.Tensor | None] = original(output)
            log_probs = tensors["trajectory_log_probs"]
            if log_probs is not None:  # "send everything at the images' precision"
                tensors["trajectory_log_probs"] = log_probs.float()
            return tensors

        return output_tensors

    return _replace(codec, "_output_tensors", make)


#: Child bugs by name: :func:`run_mutated_stage` plants one of them.
CHILD_PATCHES: dict[str, Callable[[], Patch]] = {
    "stage-aborted-output-not-sent": aborted_output_not_sent,
    "stage-exit-skips-core-shutdown": exit_skips_core_shutdown,
    "stage-log-probs-as-float32": trajectory_at_image_precision,
}


def run_mutated_stage(name: str, spec: StageSpec) -> None:
    """A stage process's entry point with the child bug ``name`` planted (tests only)."""
    with CHILD_PATCHES[name]():
        run_stage(spec)


def in_the_stage_process(name: str) -> Callable[[], Patch]:
    """The mutation that spawns stages with the child bug ``name`` planted."""

    def patch() -> Patch:
        return spawn_stages_running(functools.partial(run_mutated_stage, name))

    return patch


#: Run by the stage harness.
STAGE_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="stage-end-leaves-streams-open", mode="step", target="stage",
             bug="the client leaves streams open when the stage shuts down or dies",
             patch=end_leaves_streams_open),
    Mutation(name="stage-aborted-output-not-sent", mode="request", target="stage",
             bug="the stage does not send an aborted request's final output",
             patch=in_the_stage_process("stage-aborted-output-not-sent")),
    Mutation(name="stage-exit-skips-core-shutdown", mode="request", target="stage",
             bug="the stage exits without shutting its core down",
             patch=in_the_stage_process("stage-exit-skips-core-shutdown")),
    Mutation(name="stage-batch-failed-child-completes", mode="request", target="stage",
             bug="a batch parent ignores a child that failed and completes once every child "
                 "has ended",
             patch=batch_failed_child_completes),
    Mutation(name="stage-batch-abort-through-children", mode="step", target="stage",
             bug="the client aborts a RUNNING batch parent by aborting its prompts, so their "
                 "ends decide it",
             patch=batch_abort_through_children),
    Mutation(name="stage-batch-one-image-per-prompt", mode="request", target="stage",
             bug="a completed batch parent takes one image per prompt",
             patch=batch_one_image_per_prompt),
    Mutation(name="stage-log-probs-as-float32", mode="request", target="outputs-stage",
             bug="the stage sends a trajectory's log-probabilities at the images' precision",
             patch=in_the_stage_process("stage-log-probs-as-float32")),
)  # fmt: skip
