"""The client's side of the stage process: spawning it, the start-up handshake, stopping it."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import signal
import weakref
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.stage.endpoints import SocketDir, bind, bind_address
from diffusion_runtime.stage.errors import StageStartError
from diffusion_runtime.stage.messages import Ready, Shutdown, StartFailed, decode_from_stage, encode
from diffusion_runtime.stage.proc import StageSpec, run_stage
from diffusion_runtime.stage.security import (
    CurveGuard,
    CurveIdentity,
    launch_identities,
    secure_sockets,
)

logger = logging.getLogger(__name__)

#: How long to wait for messages a process sent just before it exited.
DRAIN_S = 0.05
#: How long a stage gets to exit after SIGTERM before it is killed.
TERMINATE_WAIT_S = 5.0


class StageProcess:
    """Owns the stage's process, the ZMQ context with both client sockets, their
    CURVE guard (TCP) and the private socket directory (IPC); :meth:`stop` ends
    and releases them all.

    ``exited`` is done the moment the process exits, however it exits (its
    sentinel is watched by the event loop, so this costs no polling).
    """

    def __init__(
        self,
        process: BaseProcess,
        ctx: zmq.asyncio.Context,
        replies: zmq.asyncio.Socket,
        requests: zmq.asyncio.Socket,
        socket_dir: SocketDir | None,
        identity: CurveIdentity | None,
        guard: CurveGuard | None,
    ) -> None:
        self.replies = replies
        self.requests = requests
        self.socket_dir = socket_dir
        #: The client's CURVE credentials for this launch (TCP), None for IPC.
        self.identity = identity
        self.ready: Ready | None = None
        self._process = process
        self.pid: int = process.pid or 0
        self._exitcode: int | None = None
        self._stopped = False
        self._finalizer = weakref.finalize(
            self, _release, process, ctx, (replies, requests), socket_dir, guard
        )
        # Runs before multiprocessing's own exit hook, which would wait for the stage forever.
        atexit.register(self._finalizer)
        self._loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_reader(process.sentinel, self._on_exit)

    @classmethod
    async def launch(
        cls,
        config: EngineConfig,
        transport: str,
        host: str,
        max_frame_bytes: int,
        max_reply_bytes: int,
        start_timeout_s: float,
    ) -> StageProcess:
        """Spawn the stage and wait until it is :class:`Ready`.

        Over TCP both sides get fresh CURVE keys; the stage's travel in the
        spawn arguments. The stage refuses request frames over
        ``max_frame_bytes``, the client reply frames over ``max_reply_bytes``.

        Raises :class:`StageStartError` (with the exit code and the stage's own
        error, when it sent one) if it fails, exits or times out; by then
        nothing it started is left.
        """
        socket_dir = SocketDir() if transport == "ipc" else None
        ctx = zmq.asyncio.Context()
        replies = ctx.socket(zmq.PULL)
        requests = ctx.socket(zmq.PUSH)
        guard, client_identity = None, None
        try:
            client_identity, stage_identity = (
                launch_identities() if transport == "tcp" else (None, None)
            )
            guard = secure_sockets(ctx, replies, requests, max_reply_bytes, client_identity)
            spec = StageSpec(
                config=config,
                reply_endpoint=bind(replies, bind_address(transport, host, socket_dir, "replies")),
                request_address=bind_address(transport, host, socket_dir, "requests"),
                max_frame_bytes=max_frame_bytes,
                max_reply_bytes=max_reply_bytes,
                curve=stage_identity,
            )
            process = multiprocessing.get_context("spawn").Process(
                target=run_stage, args=(spec,), name="diffusion-stage"
            )
            process.start()
        except BaseException:
            if guard is not None:
                guard.close()
            ctx.destroy(linger=0)
            if socket_dir is not None:
                socket_dir.close()
            raise
        stage = cls(process, ctx, replies, requests, socket_dir, client_identity, guard)
        try:
            stage.ready = await stage._handshake(start_timeout_s)
            requests.connect(stage.ready.request_endpoint)
        except BaseException:
            await stage.stop(0.0)
            raise
        return stage

    @property
    def exitcode(self) -> int | None:
        """The process's exit code once it has exited (negative: killed by that signal)."""
        if self._exitcode is None and not self._stopped and self.exited.done():
            # The sentinel fires as the process closes its files, a moment before
            # it can be reaped: join() waits for that moment.
            self._process.join()
            self._exitcode = self._process.exitcode
        return self._exitcode

    def describe_exit(self) -> str:
        return f"(pid {self.pid}) {describe_exit_code(self.exitcode)}"

    async def stop(self, grace: float) -> None:
        """Ask the stage to shut down and wait ``grace`` seconds, then SIGTERM it,
        then SIGKILL it; release every resource. Idempotent."""
        if self._stopped:
            return
        try:
            if not self.exited.done() and self.ready is not None and grace > 0:
                await self.requests.send(encode(Shutdown()))
                await asyncio.wait((self.exited,), timeout=grace)
            if not self.exited.done():
                self._process.terminate()
                await asyncio.wait((self.exited,), timeout=TERMINATE_WAIT_S)
            if not self.exited.done():
                logger.warning("the stage %s ignored SIGTERM; killing it", self.describe_exit())
                self._process.kill()
                await asyncio.wait((self.exited,), timeout=TERMINATE_WAIT_S)
            self._process.join()
            self._exitcode = self._process.exitcode
        finally:
            if not self.exited.done():
                self._loop.remove_reader(self._process.sentinel)
                self.exited.cancel()
            self._stopped = True
            atexit.unregister(self._finalizer)
            self._finalizer()

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._process.sentinel)
        if not self.exited.done():
            self.exited.set_result(None)

    async def _handshake(self, timeout: float) -> Ready:
        receive = asyncio.ensure_future(self.replies.recv_multipart(copy=False))
        try:
            await asyncio.wait(
                (receive, self.exited), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if self.exited.done() and not receive.done():
                await asyncio.wait((receive,), timeout=DRAIN_S)
            if not receive.done():
                if self.exited.done():
                    raise StageStartError(
                        f"the stage process {self.describe_exit()} during start-up",
                        self.exitcode,
                    )
                await self.stop(0.0)
                raise StageStartError(
                    f"the stage process was not ready after {timeout} s; stopped it: it "
                    f"{describe_exit_code(self.exitcode)}",
                    self.exitcode,
                )
            try:
                message = decode_from_stage(receive.result()[0].buffer)
            except Exception as exc:  # any decode failure: malformed, too deep, too large
                raise StageStartError(f"the stage's first message is unreadable: {exc!r}") from exc
        finally:
            receive.cancel()
        if isinstance(message, Ready):
            return message
        if isinstance(message, StartFailed):
            await asyncio.wait((self.exited,), timeout=TERMINATE_WAIT_S)
            raise StageStartError(
                f"the stage failed to start: {message.error} (the process "
                f"{describe_exit_code(self.exitcode)})",
                self.exitcode,
                message.error,
                message.traceback,
            )
        raise StageStartError(f"the stage sent {type(message).__name__} before Ready")


def describe_exit_code(code: int | None) -> str:
    """How a process ended, in words: its exit code, and the signal behind it."""
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by {_signal_name(-code)} (exit code {code})"
    if code > 128:
        return f"exited with code {code} ({_signal_name(code - 128)})"
    return f"exited with code {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _release(
    process: BaseProcess,
    ctx: zmq.asyncio.Context,
    sockets: tuple[zmq.asyncio.Socket, ...],
    socket_dir: SocketDir | None,
    guard: CurveGuard | None,
) -> None:
    """Release what a stage owns; when its owner never stopped it, kill it first.

    The sockets are closed by name: when this runs from the garbage collector,
    the context may no longer track them, and it would wait for them forever.
    """
    if process.exitcode is None:
        process.kill()
    process.join()
    process.close()
    for socket in sockets:
        socket.close(linger=0)
    if guard is not None:
        guard.close()
    ctx.term()
    if socket_dir is not None:
        socket_dir.close()
