"""RayExecutor: one Ray actor per worker rank, behind the DiffusionExecutor contract."""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import ray
from ray import cloudpickle

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import EngineDeadError, RPCError
from diffusion_runtime.executor.base import DiffusionExecutor, check_request_input
from diffusion_runtime.executor.failure import SHUT_DOWN, report_failure
from diffusion_runtime.executor.portable import require_serialisable, with_portable_pipeline
from diffusion_runtime.executor.ray.connection import RayConnection
from diffusion_runtime.executor.ray.failures import is_lost_worker, remote_cause
from diffusion_runtime.executor.ray.group import RayWorkerGroup
from diffusion_runtime.executor.ray.liveness import LivenessMonitor
from diffusion_runtime.executor.ray.rendezvous import GroupRendezvous
from diffusion_runtime.executor.ray.transport import WaveReply
from diffusion_runtime.executor.request_checks import serialised_request
from diffusion_runtime.executor.rpc_checks import (
    checked_method,
    checked_reply_rank,
    checked_timeout,
)
from diffusion_runtime.runner.faults import is_sticky_device_fault
from diffusion_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: The rank whose wave output is returned (every rank runs every wave).
OUTPUT_RANK = 0
# How often a blocked call looks up from Ray to see whether the executor failed meanwhile.
_FAILURE_POLL_S = 0.05


class RayExecutor(DiffusionExecutor):
    """``executor_backend="ray"``: ``num_workers`` Ray actors, one per rank, on any
    nodes of a Ray cluster.

    Each wave's scheduler output is sent to and run by every rank; the output
    rank's result comes back through the object store.
    Collective RPCs run on every rank in submission order, with ``timeout``
    enforced. A lost actor or node, a worker that misses the liveness bound, or
    a device fault fails the executor at once: every blocked and later call
    raises :class:`EngineDeadError`, and the other actors are stopped.
    :meth:`shutdown` is idempotent and also runs when the executor is
    garbage-collected.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        worker_config = _portable_config(config)
        RayConnection.acquire(config.ray_address)
        rendezvous = None
        try:
            if config.joins_process_group:
                rendezvous = GroupRendezvous(config.num_workers, config.ray_liveness_timeout_s)
            self._group = RayWorkerGroup(
                worker_config, None if rendezvous is None else rendezvous.address
            )
        except BaseException:
            if rendezvous is not None:
                rendezvous.close()
            RayConnection.release()
            raise
        self._actors: list[Any] = list(self._group.actors)
        self._shut_down = False
        # The monitor reaches the executor through a weak reference, so that a
        # forgotten executor is still collected (and its finalizer run).
        self._monitor = LivenessMonitor(
            self._actors,
            config.ray_liveness_timeout_s,
            functools.partial(report_failure, weakref.ref(self)),
        )
        self._finalizer = weakref.finalize(
            self, _release, self._monitor, self._group, rendezvous, config.shutdown_grace_s
        )
        self._validates = self._group.descriptions[0].validates
        logger.info(
            "started %d Ray worker actors: %s",
            config.num_workers,
            ", ".join(
                f"rank {d.rank} on node {d.node_id[:8]} ({d.device})"
                for d in self._group.descriptions
            ),
        )
        self.add_failure_callback(self._on_failure)
        self._monitor.start()

    # -- the contract --------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self._check_usable()
        # Passed by value: a scheduler output is small, and a ray.put per wave was measured
        # to cost more (2 ms here) than serialising it once per rank. Ray itself moves an
        # argument over 100 KiB through the object store.
        refs = [
            actor.execute.remote(scheduler_output, rank == OUTPUT_RANK)
            for rank, actor in enumerate(self._actors)
        ]
        reply: WaveReply = self._results(refs, None, "a wave")[OUTPUT_RANK]
        return reply.unpack()

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        method = checked_method(method)
        wait_s = checked_timeout(timeout)
        reply_rank = checked_reply_rank(unique_reply_rank, self.config.num_workers)
        self._check_usable()
        refs = [actor.call.remote(method, args, kwargs or {}) for actor in self._actors]
        replies = self._results(refs, wait_s, f"collective_rpc {method!r}")
        return replies if reply_rank is None else replies[reply_rank]

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        """Check a request at admission, in rank 0's side group (never behind a wave).

        The prompt must pass the input bounds, and the prompt and params must
        serialise, or they could never reach the workers.
        """
        check_request_input(prompt, params)
        serialised_request(prompt, params, _serialise, "Ray worker actors")
        if not (self._validates or params.needs_pipeline_support):
            return
        self._check_usable()
        self._results([self._actors[0].validate.remote(prompt, params)], None, "validate_request")

    def shutdown(self) -> None:
        self._shut_down = True
        self._finalizer()

    # -- introspection -------------------------------------------------------------------

    @property
    def actors(self) -> Sequence[Any]:
        """The worker actor handles, by rank."""
        return tuple(self._actors)

    @property
    def worker_node_ids(self) -> list[str]:
        """The Ray node id each rank runs on, by rank."""
        return [description.node_id for description in self._group.descriptions]

    @property
    def worker_pids(self) -> list[int]:
        """The process id of each rank's actor (on its own node), by rank."""
        return [description.pid for description in self._group.descriptions]

    # -- waiting for replies -------------------------------------------------------------

    def _results(self, refs: list[Any], timeout: float | None, what: str) -> list[Any]:
        """Every reply of ``refs``, in order; raises as the contract says.

        The wait looks up every few milliseconds so that a failure reported
        elsewhere (the liveness monitor, another caller) ends it at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = refs
        while pending:
            self._check_usable()
            wait_s = _FAILURE_POLL_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    raise RPCError(f"{what} timed out after {timeout} s")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        try:
            return [ray.get(ref) for ref in refs]
        except ray.exceptions.RayError as exc:
            raise self._as_runtime_error(exc, what) from exc

    def _check_usable(self) -> None:
        self.check_health()
        if self._shut_down:
            raise EngineDeadError(SHUT_DOWN)

    def _as_runtime_error(self, exc: ray.exceptions.RayError, what: str) -> BaseException:
        if self._shut_down:
            return EngineDeadError(SHUT_DOWN)
        if is_lost_worker(exc):
            reason = f"a Ray worker was lost during {what}: {exc}"
            self.mark_failed(reason)
            return EngineDeadError(reason)
        cause = remote_cause(exc)
        if is_sticky_device_fault(cause):
            reason = f"device fault on a Ray worker: {cause}"
            self.mark_failed(reason)
            return EngineDeadError(reason)
        return cause

    def _on_failure(self, reason: str) -> None:
        # The other workers are stopped, as with mp; their pending replies fail at once.
        for actor in self._actors:
            ray.kill(actor, no_restart=True)


def _portable_config(config: EngineConfig) -> EngineConfig:
    """``config`` as the actors receive it: a pipeline registered in this process by
    name is sent as its factory; whatever is sent must serialise (cloudpickle)."""
    config = with_portable_pipeline(config)
    rule = "must be serialisable to reach Ray worker actors"
    require_serialisable(
        [
            ("pipeline", config.pipeline, rule),
            ("pipeline_kwargs", config.pipeline_kwargs, rule),
            ("worker_extensions", config.worker_extensions, rule),
        ],
        _serialise,
    )
    return config


def _serialise(value: object) -> bytes:
    """``value`` as Ray sends it to an actor (cloudpickle: lambdas and local classes too)."""
    data: bytes = cloudpickle.dumps(value)  # type: ignore[no-untyped-call]
    return data


def _release(
    monitor: LivenessMonitor,
    group: RayWorkerGroup,
    rendezvous: GroupRendezvous | None,
    grace: float,
) -> None:
    """Stop pinging, stop the actors, stop serving their group's store, then leave
    Ray (if no other executor uses it)."""
    monitor.stop()
    try:
        group.stop(grace)
    finally:
        if rendezvous is not None:
            rendezvous.close()
        RayConnection.release()
