"""UniProcExecutor: the worker lives in the engine process; no IPC at all."""

from __future__ import annotations

import threading
from typing import Any

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import DeviceFault, EngineDeadError, RPCError
from diffusion_runtime.executor.base import DiffusionExecutor, check_request_input
from diffusion_runtime.executor.rpc_checks import (
    checked_method,
    checked_reply_rank,
    checked_timeout,
)
from diffusion_runtime.runner.worker import Worker
from diffusion_runtime.sampling_params import SamplingParams


class UniProcExecutor(DiffusionExecutor):
    """One in-process worker, called directly.

    A call runs on the caller's thread and cannot be abandoned, so an RPC
    with a finite ``timeout`` is refused (:class:`RPCError`) rather than
    silently waited for; the ``mp`` executor enforces timeouts.
    """

    validates_in_process = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.num_workers != 1:
            raise ValueError(
                "EngineConfig.num_workers must be 1 for the 'uni' executor; "
                f"got {config.num_workers}"
            )
        self._worker: Worker | None = Worker(config, rank=0)
        self._bound_thread = threading.get_ident()

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        result: RunnerOutput = self._call("execute_model", (scheduler_output,), {})
        return result

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        method = checked_method(method)
        reply_rank = checked_reply_rank(unique_reply_rank, 1)
        if checked_timeout(timeout) is not None:
            raise RPCError(
                f"collective_rpc {method!r}: the 'uni' executor runs calls on the caller's "
                "thread and cannot abandon one, so it refuses a finite timeout; "
                "pass timeout=None or use the 'mp' executor"
            )
        reply = self._call(method, args, kwargs or {})
        return reply if reply_rank == 0 else [reply]

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        check_request_input(prompt, params)
        self._call("validate_request", (prompt, params), {})

    def shutdown(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown()

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.check_health()
        worker = self._worker
        if worker is None:
            raise EngineDeadError("the executor was shut down")
        if self._bound_thread != threading.get_ident():
            worker.bind_thread()
            self._bound_thread = threading.get_ident()
        try:
            return worker.call(method, *args, **kwargs)
        except DeviceFault as exc:
            self.mark_failed(f"device fault on {worker.device}: {exc}")
            raise EngineDeadError(f"device fault on {worker.device}: {exc}") from exc
