"""The worker processes and their pipes: start-up handshake, sending, stopping."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from diffusion_runtime.errors import DiffusionRuntimeError, EngineDeadError
from diffusion_runtime.executor.mp.messages import Ready, StartFailed, Stop, dumps, loads
from diffusion_runtime.executor.mp.pipe_writer import PipeWriter
from diffusion_runtime.executor.mp.spec import WorkerSpec
from diffusion_runtime.executor.mp.wakeup import Wakeup
from diffusion_runtime.executor.mp.worker_proc import (
    MAIN_GUARD_ADVICE,
    UNGUARDED_MAIN_EXIT_CODE,
    exit_if_starting_as_worker,
    run_worker,
)


class WorkerStartError(DiffusionRuntimeError):
    """A worker process failed to start. Nothing the executor started is left running.

    ``__cause__`` is the worker's own exception when it raised one.
    """

    def __init__(self, rank: int, cause: str) -> None:
        self.rank = rank
        self.cause = cause
        super().__init__(f"worker {rank} failed to start: {cause}")

    def __reduce__(self) -> tuple[type[WorkerStartError], tuple[int, str]]:
        return type(self), (self.rank, self.cause)


class WorkerGroup:
    """Owns the worker processes and their pipes: commands to each, results and
    heartbeats from each, and rank 0's side pipe.

    Construction spawns one process per spec and returns once every worker
    reported :class:`Ready`; if any fails, dies or misses the deadline, every
    process is stopped, every pipe closed, and :class:`WorkerStartError` names
    the rank and the cause.
    """

    def __init__(self, specs: Sequence[WorkerSpec], start_timeout: float) -> None:
        exit_if_starting_as_worker()
        context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self._abandon = Wakeup()
        self._commands: list[PipeWriter] = []
        self._results: list[Connection] = []
        self._heartbeats: list[Connection] = []
        self._side: PipeWriter | None = None
        self._command_locks = [threading.Lock() for _ in specs]
        self._side_lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.ready: list[Ready] = []
        try:
            for spec in specs:
                commands_read, commands_write = context.Pipe(duplex=False)
                results_read, results_write = context.Pipe(duplex=False)
                beats_read, beats_write = context.Pipe(duplex=False)
                side_read = None
                if spec.rank == 0:
                    side_read, side_write = context.Pipe(duplex=False)
                    self._side = PipeWriter(side_write, 0, self._abandon)
                self._commands.append(PipeWriter(commands_write, spec.rank, self._abandon))
                self._results.append(results_read)
                self._heartbeats.append(beats_read)
                process = context.Process(
                    target=run_worker,
                    args=(spec, commands_read, side_read, results_write, beats_write),
                    name=f"diffusion-worker-{spec.rank}",
                    daemon=True,
                )
                try:
                    process.start()
                finally:
                    for end in (commands_read, side_read, results_write, beats_write):
                        if end is not None:
                            end.close()
                self.processes.append(process)
            self.ready = self._handshake(start_timeout)
        except BaseException:
            self.stop(grace=0.0)
            self.close()
            raise

    @property
    def result_connections(self) -> list[Connection]:
        return list(self._results)

    @property
    def heartbeat_connections(self) -> list[Connection]:
        """Each worker's heartbeat pipe, by rank (see :class:`DeathMonitor`)."""
        return list(self._heartbeats)

    # -- sending -------------------------------------------------------------------------

    def send(self, rank: int, data: bytes) -> None:
        """Send one encoded command to ``rank``; :class:`EngineDeadError` if it is gone
        or writes were abandoned while its pipe was full."""
        with self._command_locks[rank]:
            self._commands[rank].send(data)

    def broadcast(self, data: bytes) -> None:
        for rank in range(len(self._commands)):
            self.send(rank, data)

    def send_side(self, data: bytes) -> None:
        """Send one encoded message to rank 0's side thread (it never waits for a wave)."""
        assert self._side is not None
        with self._side_lock:
            self._side.send(data)

    def abandon_writes(self) -> None:
        """End every send waiting on a full pipe, now and later (the group is going away)."""
        self._abandon.set()

    # -- stopping ------------------------------------------------------------------------

    def stop(self, grace: float) -> None:
        """Ask every worker to stop, wait up to ``grace`` seconds, then kill what is left.

        Returns within ``grace`` plus the time to reap killed processes.
        Idempotent; a second caller waits for the first to finish.
        """
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            deadline = time.monotonic() + grace
            # A full pipe now ends the send at once: a worker that is not reading gets no Stop.
            self.abandon_writes()
            stop = dumps(Stop())
            for rank, process in enumerate(self.processes):
                if process.is_alive():
                    with contextlib.suppress(EngineDeadError):
                        self.send(rank, stop)
            while (alive := [p.sentinel for p in self.processes if p.is_alive()]) and (
                remaining := deadline - time.monotonic()
            ) > 0:
                wait(alive, remaining)
            for rank in range(len(self.processes)):
                self.kill(rank)
            for process in self.processes:
                process.join()

    def kill(self, rank: int) -> None:
        """``SIGKILL`` worker ``rank`` if it still runs (a stopped process dies too)."""
        process = self.processes[rank]
        if process.is_alive():
            process.kill()

    def close(self) -> None:
        """Close every pipe of every worker and the process handles (after :meth:`stop`)."""
        for end in [*self._commands, *self._results, *self._heartbeats, self._side]:
            if end is not None:
                end.close()
        self._abandon.close()
        for process in self.processes:
            if process.exitcode is not None:
                process.close()

    def describe_exit(self, rank: int) -> str:
        """How worker ``rank`` ended, with its pid and exit code or signal."""
        return f"worker {rank} (pid {self.processes[rank].pid}) {self._exit_status(rank)}"

    def _exit_status(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(1.0)
        code = process.exitcode
        if code is None:
            return "is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name} (exit code {code})"
        return f"exited with code {code}"

    # -- start-up ------------------------------------------------------------------------

    def _handshake(self, timeout: float) -> list[Ready]:
        deadline = time.monotonic() + timeout
        ready: dict[int, Ready] = {}
        pending = {connection: rank for rank, connection in enumerate(self._results)}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(pending.values())
                raise WorkerStartError(
                    missing[0], f"not ready after {timeout} s (ranks still starting: {missing})"
                )
            events = wait([*pending, *sentinels], remaining)
            # Read pipes before sentinels: a failing worker reports, then exits.
            for connection in [e for e in events if isinstance(e, Connection)]:
                rank = pending.pop(connection)
                ready[rank] = self._receive_ready(connection, rank)
            for sentinel in [e for e in events if isinstance(e, int)]:
                rank = sentinels[sentinel]
                connection = self._results[rank]
                if connection in pending and connection.poll():
                    del pending[connection]
                    ready[rank] = self._receive_ready(connection, rank)
                raise WorkerStartError(rank, self._died(rank))
        return [ready[rank] for rank in range(len(self.processes))]

    def _receive_ready(self, connection: Connection, rank: int) -> Ready:
        try:
            message = loads(connection.recv_bytes())
        except (EOFError, OSError):
            raise WorkerStartError(rank, self._died(rank)) from None
        if isinstance(message, StartFailed):
            raise WorkerStartError(rank, message.error.description) from message.error.rebuild()
        if not isinstance(message, Ready):
            raise WorkerStartError(rank, f"sent {type(message).__name__} instead of Ready")
        return message

    def _died(self, rank: int) -> str:
        pid = self.processes[rank].pid
        died = f"its process (pid {pid}) {self._exit_status(rank)} during start-up"
        if self.processes[rank].exitcode == UNGUARDED_MAIN_EXIT_CODE:
            return f"{died}: {MAIN_GUARD_ADVICE}"
        return died
