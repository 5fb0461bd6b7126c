"""MultiprocExecutor: one worker process per device, behind the DiffusionExecutor contract."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import EngineDeadError, RPCError
from diffusion_runtime.executor.base import DiffusionExecutor, check_request_input
from diffusion_runtime.executor.failure import SHUT_DOWN, report_failure
from diffusion_runtime.executor.mp.calls import CallTable
from diffusion_runtime.executor.mp.group import WorkerGroup
from diffusion_runtime.executor.mp.messages import (
    Call,
    ComputeDone,
    Execute,
    Fatal,
    FromWorker,
    OutputReady,
    ReleaseSegment,
    Reply,
    Validate,
    dumps,
    loads,
)
from diffusion_runtime.executor.mp.monitor import DeathMonitor
from diffusion_runtime.executor.mp.pump import ResultPump
from diffusion_runtime.executor.mp.segments import SEGMENT_PREFIX, OutputReader, sweep
from diffusion_runtime.executor.mp.spec import WorkerSpec, worker_config
from diffusion_runtime.executor.request_checks import serialised_request
from diffusion_runtime.executor.rpc_checks import (
    checked_method,
    checked_reply_rank,
    checked_timeout,
)
from diffusion_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: The name prefix of a process group's rendezvous directory (then the engine's pid).
RENDEZVOUS_PREFIX = "diffusion-rt-dist-"


class MultiprocExecutor(DiffusionExecutor):
    """``executor_backend="mp"``: ``num_workers`` spawned processes, one per device.

    Every rank runs every wave and RPC; rank 0 reports waves, and an RPC's
    named ranks reply, matched to their caller by call id. Wave images cross
    through shared memory; everything else is a small pickled message over a
    private pipe. A worker death or device fault fails the executor at once:
    every blocked call raises :class:`EngineDeadError` and the other workers
    are stopped. :meth:`shutdown` is idempotent and also runs when the
    executor is garbage-collected or the interpreter exits.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        config_sent = worker_config(config)
        self._segment_prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._dist_dir: str | None = None
        init_method = None
        if config.joins_process_group:
            self._dist_dir = tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-")
            init_method = f"file://{self._dist_dir}/rendezvous"
        specs = [
            WorkerSpec(config_sent, rank, self._segment_prefix, init_method)
            for rank in range(config.num_workers)
        ]
        try:
            self._group = WorkerGroup(specs, config.worker_start_timeout_s)
        except BaseException:
            _remove_leftovers(self._segment_prefix, self._dist_dir)
            raise
        self._calls = CallTable()
        self._reader = OutputReader()
        this = weakref.ref(self)
        self._pump = ResultPump(self._group.result_connections, functools.partial(_deliver, this))
        self._monitor = DeathMonitor(
            self._group,
            functools.partial(report_failure, this),
            config.shutdown_grace_s,
            config.worker_liveness_timeout_s,
        )
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._calls,
            self._monitor,
            self._group,
            self._pump,
            self._reader,
            self._segment_prefix,
            self._dist_dir,
            config.shutdown_grace_s,
        )
        self._rank0_validates = self._group.ready[0].validates
        logger.info(
            "started %d worker processes: %s",
            config.num_workers,
            ", ".join(f"rank {r.rank} pid {r.pid} on {r.device}" for r in self._group.ready),
        )
        self.add_failure_callback(self._on_failure)
        try:
            self._pump.start()
            self._monitor.start()
        except BaseException:
            self._finalizer()
            raise

    # -- the contract --------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.check_health()
        call = self._calls.open_wave()
        try:
            self._send(self._group.broadcast, dumps(Execute(call.call_id, scheduler_output)))
            ready = call.future.result()
        finally:
            self._calls.discard(call.call_id)
        try:
            tensors = self._reader.copy_out(ready.segment, ready.inline, ready.slots)
        finally:
            if ready.segment is not None:
                self._release_segment(ready.segment)
        return ready.output.with_tensors(tensors)

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
        try:
            payload = dumps((args, kwargs or {}))
        except RecursionError:
            raise RPCError(f"the arguments of {method!r} are nested too deeply to pickle") from None
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise RPCError(f"the arguments of {method!r} cannot be pickled: {exc}") from exc
        self.check_health()
        ranks = tuple(range(self.config.num_workers)) if reply_rank is None else (reply_rank,)
        call = self._calls.open_rpc(method, ranks)
        try:
            self._send(
                self._group.broadcast, dumps(Call(call.call_id, method, payload, reply_rank))
            )
            try:
                replies = call.future.result(wait_s)
            except FutureTimeout:
                # Its reply, when it comes, finds no call and is dropped.
                raise RPCError(f"collective_rpc {method!r} timed out after {timeout} s") from None
        finally:
            self._calls.discard(call.call_id)
        values = [_load_reply(method, replies[rank]) for rank in ranks]
        return values[0] if reply_rank is not None else values

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        """Check a request at admission, on rank 0's side thread.

        The check does not queue behind a running wave, and costs nothing when
        the pipeline has no ``validate_request`` and the request asks for images
        alone. Either way the prompt and
        params must pickle, or they could never reach the workers.
        """
        check_request_input(prompt, params)
        payload = serialised_request(prompt, params, dumps, "worker processes")
        if not (self._rank0_validates or params.needs_pipeline_support):
            return
        self.check_health()
        call = self._calls.open_rpc("validate_request", (0,))
        try:
            self._send(self._group.send_side, dumps(Validate(call.call_id, payload)))
            call.future.result()
        finally:
            self._calls.discard(call.call_id)

    def shutdown(self) -> None:
        self._finalizer()

    # -- introspection -------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        return [ready.pid for ready in self._group.ready]

    @property
    def segment_prefix(self) -> str:
        """The name prefix of every shared-memory segment this executor's workers create."""
        return self._segment_prefix

    # -- messages from the workers (the result pump's thread) ----------------------------

    def _on_worker_message(self, message: FromWorker) -> None:
        if isinstance(message, Reply):
            self._calls.on_reply(message)
        elif isinstance(message, ComputeDone):
            self._calls.on_compute_done(message.call_id)
        elif isinstance(message, OutputReady):
            self._reader.forget(message.retired)
            if self._calls.on_output_ready(message) and message.segment is not None:
                self._release_segment(message.segment)
        elif isinstance(message, Fatal):
            self.mark_failed(f"device fault on worker {message.rank}: {message.reason}")
        else:
            logger.warning("ignored an unexpected %s from a worker", type(message).__name__)

    def _send(self, send: Callable[[bytes], None], data: bytes) -> None:
        """Send through the group; a worker that cannot be reached has died.

        A send abandoned because the executor failed meanwhile raises that failure.
        """
        try:
            send(data)
        except EngineDeadError as exc:
            if not self._calls.closed:  # not a send racing shutdown
                self.mark_failed(str(exc))
            raise EngineDeadError(self._failure or str(exc)) from exc

    def _release_segment(self, name: str) -> None:
        try:
            self._group.send_side(dumps(ReleaseSegment(name)))
        except Exception:  # rank 0 is gone; its segments are swept at shutdown
            logger.debug("could not hand segment %s back to rank 0", name)

    def _on_failure(self, reason: str) -> None:
        self._group.abandon_writes()
        self._calls.close(reason)
        self._monitor.stop_workers()


def _load_reply(method: str, payload: bytes) -> Any:
    try:
        return loads(payload)
    except Exception as exc:
        raise RPCError(f"the reply to {method!r} cannot be unpickled here: {exc}") from exc


def _deliver(executor_ref: weakref.ref[MultiprocExecutor], message: FromWorker) -> bool:
    executor = executor_ref()
    if executor is None:
        return False
    try:
        executor._on_worker_message(message)
    except Exception as exc:
        logger.exception("handling a worker message failed")
        executor.mark_failed(f"handling a worker message failed: {exc!r}")
    return True


def _release(
    calls: CallTable,
    monitor: DeathMonitor,
    group: WorkerGroup,
    pump: ResultPump,
    reader: OutputReader,
    segment_prefix: str,
    dist_dir: str | None,
    grace: float,
) -> None:
    """Shut everything down, in an order where nothing waits on what is already gone."""
    calls.close(SHUT_DOWN)
    monitor.close()
    group.stop(grace)
    pump.close()
    group.close()
    reader.close()
    _remove_leftovers(segment_prefix, dist_dir)


def _remove_leftovers(segment_prefix: str, dist_dir: str | None) -> None:
    left = sweep(segment_prefix)
    if left:
        logger.info("unlinked %d shared-memory segments left by workers", len(left))
    if dist_dir is not None:
        shutil.rmtree(dist_dir, ignore_errors=True)
