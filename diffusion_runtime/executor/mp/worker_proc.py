"""One worker process: hosts a :class:`Worker` and serves the executor's messages.

Threads in the process:

- the main thread builds the worker, then reads the command pipe and runs
  commands (waves, collective RPCs) one at a time, in arrival order;
- on rank 0, the side thread reads a second pipe whose messages must not
  wait behind a running wave: admission checks (:class:`Validate`) and
  segment releases;
- on rank 0, the packer thread copies each wave's images into shared memory
  while the main thread is already free for the next command;
- the watchdog thread waits on the engine process's sentinel and ends this
  process if the engine process dies without stopping it;
- the heartbeat thread writes to the heartbeat pipe several times per
  ``worker_liveness_timeout_s``: when the process is stopped or frozen (a
  signal, a deadlock holding the interpreter), the beats stop and the
  executor's death monitor declares the worker hung.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import torch

from diffusion_runtime.contracts import RunnerOutput
from diffusion_runtime.errors import InvalidFieldError, RPCError, describe_error
from diffusion_runtime.executor.mp.messages import (
    Call,
    ComputeDone,
    Execute,
    Fatal,
    FromWorker,
    OutputReady,
    Ready,
    ReleaseSegment,
    Reply,
    StartFailed,
    Stop,
    Validate,
    dumps,
    loads,
)
from diffusion_runtime.executor.mp.remote_error import RemoteError
from diffusion_runtime.executor.mp.segments import INLINE_OUTPUT_BYTES, OutputArena, pack_inline
from diffusion_runtime.executor.mp.spec import WorkerSpec
from diffusion_runtime.runner.faults import is_sticky_device_fault
from diffusion_runtime.runner.worker import Worker, worker_device

logger = logging.getLogger(__name__)

#: The exit status of a process that tried to start workers while it was itself
#: starting up as a worker: the main module created an engine without a guard.
UNGUARDED_MAIN_EXIT_CODE = os.EX_CONFIG

MAIN_GUARD_ADVICE = (
    "worker processes are started with 'spawn', which imports the main module "
    "again in each worker; that import created another engine. Create mp engines "
    'under `if __name__ == "__main__":` in the main module (or in a function it calls)'
)


def exit_if_starting_as_worker() -> None:
    """Refuse to start workers from a process that is still starting as a worker.

    Under 'spawn', a worker imports the main module before it runs; an engine
    created at that module's top level would start workers of its own, forever.
    This process says why on stderr and exits with
    :data:`UNGUARDED_MAIN_EXIT_CODE`, which the parent reports with the same advice.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.write(f"diffusion-runtime: {MAIN_GUARD_ADVICE}\n")
        sys.stderr.flush()
        raise SystemExit(UNGUARDED_MAIN_EXIT_CODE)


#: Beats sent per liveness timeout: a late beat or two never looks like a hang.
BEATS_PER_TIMEOUT = 5


def run_worker(
    spec: WorkerSpec,
    commands: Connection,
    side: Connection | None,
    results: Connection,
    heartbeats: Connection,
) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the engine process to handle
    _progress_bars_without_process_locks()
    WorkerProcess(spec, commands, side, results, heartbeats).serve()


def _progress_bars_without_process_locks() -> None:
    """Give tqdm (diffusers' loading bars) a thread lock before it makes its own.

    Its default is a ``multiprocessing`` lock, a named semaphore registered with
    the resource tracker this process shares with the engine: a worker stopped
    at once (another rank failed to start) leaves it there, and the engine
    process warns of leaked semaphores when it exits.
    """
    with contextlib.suppress(ImportError):
        from tqdm import std

        std.tqdm.set_lock(threading.RLock())


class Heartbeat:
    """A thread that writes an empty frame every ``interval`` seconds until stopped."""

    def __init__(self, connection: Connection, interval: float) -> None:
        self._connection = connection
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="diffusion-worker-heartbeat", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop beating and close the pipe."""
        self._stopped.set()
        if self._thread.ident is not None:
            self._thread.join()
        self._connection.close()

    def _run(self) -> None:
        while True:
            try:
                self._connection.send_bytes(b"")
            except OSError:  # the executor is gone; the watchdog ends the process
                return
            if self._stopped.wait(self._interval):
                return


class Outbox:
    """The pipe to the executor, shared by the worker's threads.

    A failed write means the executor is gone; the watchdog thread sees that too
    and ends the process, so the write error itself is dropped.
    """

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, message: FromWorker) -> None:
        data = dumps(message)
        with self._lock, contextlib.suppress(OSError):
            self._connection.send_bytes(data)


class OutputPacker:
    """Rank 0's two reports of a wave: :class:`ComputeDone`, then :class:`OutputReady`.

    An output of up to :data:`INLINE_OUTPUT_BYTES` whose tensors are already
    in host memory is packed into the message at once. A larger one, or one
    whose device copy is still in flight (its ``output_ready`` fence), is
    queued to the packer thread, which waits for the fence and copies the
    tensors into shared memory while the main thread is already free for the
    next command. The executor accepts the two reports in either order.
    """

    def __init__(self, arena: OutputArena, outbox: Outbox) -> None:
        self._arena = arena
        self._outbox = outbox
        self._jobs: queue.SimpleQueue[tuple[int, RunnerOutput] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="diffusion-worker-packer", daemon=True
        )
        self._thread.start()

    def report(self, call_id: int, output: RunnerOutput) -> None:
        # ComputeDone goes first: a packer thread woken before it would hold the
        # GIL for up to a switch interval (5 ms) while this thread waits to send.
        self._outbox.send(ComputeDone(call_id))
        nbytes = sum(t.numel() * t.element_size() for _, _, t in _tensors(output))
        if nbytes > INLINE_OUTPUT_BYTES or not output.output_ready.is_ready():
            self._jobs.put((call_id, output))
        else:
            self._send_ready(call_id, output, shared=False)

    def close(self) -> None:
        """Pack what was queued, then stop."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._send_ready(*job, shared=True)

    def _send_ready(self, call_id: int, output: RunnerOutput, *, shared: bool) -> None:
        try:
            output = output.settled()
            tensors = _tensors(output)
            stripped = output.without_tensors()
            if shared:
                segment, slots, retired = self._arena.pack(tensors)
                ready = OutputReady(call_id, stripped, segment, b"", slots, retired)
            else:
                inline, slots = pack_inline(tensors)
                ready = OutputReady(call_id, stripped, None, inline, slots, ())
            self._outbox.send(ready)
        except Exception as exc:
            self._outbox.send(Reply(call_id, 0, error=RemoteError.capture(exc, 0)))


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _tensors(output: RunnerOutput) -> list[tuple[str, str, torch.Tensor]]:
    return [
        (field, request_id, tensor)
        for field, tensors in output.tensor_fields().items()
        for request_id, tensor in tensors.items()
    ]


class WorkerProcess:
    """The body of one worker process (see the module docstring for its threads)."""

    def __init__(
        self,
        spec: WorkerSpec,
        commands: Connection,
        side: Connection | None,
        results: Connection,
        heartbeats: Connection,
    ) -> None:
        self.spec = spec
        self.rank = spec.rank
        self._commands = commands
        self._side = side
        self._results = results
        self._outbox = Outbox(results)
        interval = spec.config.worker_liveness_timeout_s / BEATS_PER_TIMEOUT
        self._heartbeat = Heartbeat(heartbeats, interval)
        self._worker: Worker | None = None
        self._arena: OutputArena | None = None
        self._packer: OutputPacker | None = None

    def serve(self) -> None:
        """Start, report Ready (or why not), serve until Stop, release everything."""
        try:
            worker = self._start()
        except Exception as exc:
            self._outbox.send(StartFailed(self.rank, RemoteError.capture(exc, self.rank)))
            self._release()
            return
        # An adapter's file is checked at admission too (Worker.validate_request).
        validates = (
            getattr(worker.pipeline, "validate_request", None) is not None
            or worker.adapters is not None
        )
        self._outbox.send(Ready(self.rank, os.getpid(), str(worker.device), validates))
        self._heartbeat.start()
        self._start_thread(self._watch_executor, "diffusion-worker-watchdog")
        if self._side is not None:
            self._start_thread(self._serve_side, "diffusion-worker-side")
        try:
            self._serve_commands(worker)
        finally:
            self._release()

    @staticmethod
    def _start_thread(target: Callable[[], None], name: str) -> None:
        # Daemon threads: they block in reads that end with the process.
        threading.Thread(target=target, name=name, daemon=True).start()

    # -- start and stop ------------------------------------------------------------------

    def _start(self) -> Worker:
        config = self.spec.config
        device = worker_device(config, self.rank)
        if device.type == "cpu" and config.num_workers > 1:
            # Workers share the machine's cores; without this each would use all of them.
            torch.set_num_threads(max(1, _usable_cores() // config.num_workers))
        if self.spec.dist_init_method is not None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # The timeout bounds every collective: a rank left waiting on a dead or
            # hung peer fails its call instead of blocking past the liveness bound.
            torch.distributed.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method=self.spec.dist_init_method,
                world_size=config.num_workers,
                rank=self.rank,
                timeout=datetime.timedelta(seconds=config.worker_liveness_timeout_s),
            )
        self._worker = Worker(config, self.rank)
        if self.rank == 0:
            self._arena = OutputArena(f"{self.spec.segment_prefix}r0-")
            self._packer = OutputPacker(self._arena, self._outbox)
        return self._worker

    def _release(self) -> None:
        self._heartbeat.close()
        if self._packer is not None:
            self._packer.close()
        if self._arena is not None:
            self._arena.close()
        if self._worker is not None:
            self._worker.shutdown()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for connection in (self._commands, self._side, self._results):
            if connection is not None:
                connection.close()

    # -- helper threads ------------------------------------------------------------------

    def _watch_executor(self) -> None:
        parent = multiprocessing.parent_process()
        assert parent is not None, "a worker process is always started by the executor"
        wait([parent.sentinel])
        self._executor_gone()

    def _serve_side(self) -> None:
        assert self._side is not None
        while True:
            try:
                message = loads(self._side.recv_bytes())
            except (EOFError, OSError):
                return
            if isinstance(message, ReleaseSegment):
                if self._arena is not None:
                    self._arena.release(message.name)
            elif isinstance(message, Validate):
                self._validate(message)

    def _executor_gone(self) -> NoReturn:
        """The engine process is gone without stopping us: nobody will read our results."""
        logger.warning("worker %d: the executor is gone; exiting", self.rank)
        if self._arena is not None:
            self._arena.unlink_all()
        sys.stderr.flush()
        os._exit(1)

    def _validate(self, message: Validate) -> None:
        worker = self._worker
        assert worker is not None
        try:
            prompt, params = loads(message.payload)
        except Exception as exc:
            error = InvalidFieldError(
                "request", "prompt", "must be importable in worker processes", describe_error(exc)
            )
            self._reply_error(message.call_id, error)
            return
        try:
            worker.call("validate_request", prompt, params)
        except Exception as exc:
            self._reply_error(message.call_id, exc)
        else:
            self._outbox.send(Reply(message.call_id, self.rank, dumps(None)))

    # -- the main thread -----------------------------------------------------------------

    def _serve_commands(self, worker: Worker) -> None:
        while True:
            try:
                command = loads(self._commands.recv_bytes())
            except (EOFError, OSError):
                self._executor_gone()
            if isinstance(command, Stop):
                return
            if isinstance(command, Execute):
                self._execute(worker, command)
            elif isinstance(command, Call):
                self._call(worker, command)

    def _execute(self, worker: Worker, command: Execute) -> None:
        try:
            output = worker.call("execute_model", command.output)
        except Exception as exc:
            self._report_fault(exc)
            self._reply_error(command.call_id, exc)
            return
        if self._packer is not None:
            self._packer.report(command.call_id, output)

    def _call(self, worker: Worker, command: Call) -> None:
        replies = command.reply_rank is None or command.reply_rank == self.rank
        try:
            args, kwargs = loads(command.payload)
            value = worker.call(command.method, *args, **kwargs)
        except Exception as exc:
            self._report_fault(exc)
            if replies:
                self._reply_error(command.call_id, exc)
            else:
                logger.warning("worker %d: %s failed: %s", self.rank, command.method, exc)
            return
        if not replies:
            return
        try:
            payload = dumps(value)
        except Exception as exc:
            error = RPCError(f"{command.method} returned a value that cannot be pickled: {exc}")
            self._reply_error(command.call_id, error)
        else:
            self._outbox.send(Reply(command.call_id, self.rank, payload))

    def _report_fault(self, exc: Exception) -> None:
        if is_sticky_device_fault(exc):
            self._outbox.send(Fatal(self.rank, describe_error(exc)))

    def _reply_error(self, call_id: int, exc: Exception) -> None:
        self._outbox.send(Reply(call_id, self.rank, error=RemoteError.capture(exc, self.rank)))
