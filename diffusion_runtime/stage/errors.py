"""Errors only the stage raises; everything else crosses as the runtime's own errors."""

from __future__ import annotations

from diffusion_runtime.errors import DiffusionRuntimeError


class StageStartError(DiffusionRuntimeError):
    """The stage process did not become ready; it has been stopped.

    ``exitcode`` is the process's exit code (negative: killed by that signal)
    or None if it could not be read; ``child_error`` is the error the process
    reported before it exited (with ``child_traceback``), or None if it sent none.
    """

    def __init__(
        self,
        message: str,
        exitcode: int | None = None,
        child_error: str | None = None,
        child_traceback: str | None = None,
    ) -> None:
        self.exitcode = exitcode
        self.child_error = child_error
        self.child_traceback = child_traceback
        super().__init__(message)


class StageProtocolError(DiffusionRuntimeError):
    """A message could not be read, or did not fit the protocol, on the other side."""
