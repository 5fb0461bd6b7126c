"""DiffusionExecutor: the interface every execution backend implements."""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import EngineDeadError
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.validation import bounded_input

logger = logging.getLogger(__name__)


class DiffusionExecutor(abc.ABC):
    """Runs scheduler outputs on workers and reports results keyed by request id.

    An executor never decides what runs: it executes exactly the ids of each
    :class:`SchedulerOutput`, and sees nothing else. It keeps no table by
    request id: a request's end reaches the workers as ``finished_ids`` of a
    later output, and the core ignores results of requests that ended.
    Ordinary pipeline errors come back per request inside the
    :class:`RunnerOutput`; a failure of the worker group (a dead process, a
    sticky device fault) marks the executor failed for good, and every later
    call raises :class:`EngineDeadError`.
    """

    #: Whether :meth:`validate_request` runs in this process without waiting on a
    #: worker (an async front then calls it on its event loop, else off the loop).
    validates_in_process: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._failure_lock = threading.Lock()
        #: The level the workers sleep at (:meth:`sleep`), or ``None`` while awake.
        self.sleep_level: int | None = None

    # -- the contract ----------------------------------------------------------------

    @abc.abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one wave or step and return its per-request results."""

    @abc.abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call ``method`` on every worker; a list of replies by rank, or the one
        reply of ``unique_reply_rank``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release every resource. Idempotent."""

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        """Raise ``ValueError`` for input the pipeline cannot serve (called at admission).

        Overrides call :func:`check_request_input` first, as this one does.
        """
        check_request_input(prompt, params)
        self.collective_rpc("validate_request", (prompt, params), unique_reply_rank=0)

    # -- operations: sleep and profiling, on every worker ------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free every worker's device memory at ``level`` (1: weights to host memory;
        2: weights dropped). The caller sends no wave until :meth:`wake_up`."""
        self.collective_rpc("sleep_device", (level,))
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restore on every worker what :meth:`sleep` freed."""
        self.collective_rpc("wake_device")
        self.sleep_level = None

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None

    def start_profile(self, prefix: str) -> list[str]:
        """Start ``torch.profiler`` on every worker; the trace paths, by rank."""
        paths: list[str] = self.collective_rpc("start_profile", (prefix,))
        return paths

    def stop_profile(self) -> list[str]:
        """Stop profiling and write one trace per worker; their paths, by rank."""
        paths: list[str] = self.collective_rpc("stop_profile")
        return paths

    # -- health ------------------------------------------------------------------------

    @property
    def is_failed(self) -> bool:
        return self._failure is not None

    def check_health(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def add_failure_callback(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(reason)`` once when the executor fails (at once if it already has)."""
        with self._failure_lock:
            failure = self._failure
            if failure is None:
                self._failure_callbacks.append(fn)
        if failure is not None:
            fn(failure)

    def mark_failed(self, reason: str) -> None:
        """Record a fatal failure; the first reason wins and callbacks run once."""
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = reason
            callbacks, self._failure_callbacks = self._failure_callbacks, []
        logger.error("executor failed: %s", reason)
        for fn in callbacks:
            fn(reason)


def check_request_input(prompt: Any, params: SamplingParams) -> None:
    """Refuse a prompt whose nesting or size passes the input bounds (see
    :func:`~diffusion_runtime.validation.bounded_input`), before it is pickled or
    reaches a pipeline. ``params.extra_args`` were bounded when ``params`` was built."""
    bounded_input("request", "prompt", prompt)
