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
from collections.abc import Callable
from typing import Any

from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
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


#: Child bugs by name: :func:`run_mutated_stage` plants one of them.
CHILD_PATCHES: dict[str, Callable[[], Patch]] = {
    "stage-aborted-output-not-sent": aborted_output_not_sent,
    "stage-exit-skips-core-shutdown": exit_skips_core_shutdown,
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
)  # fmt: skip
