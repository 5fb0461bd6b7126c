"""The stage process: an :class:`~diffusion_runtime.core.EngineCore` served over two
ZMQ sockets by one loop on the process's only thread.

The process connects a PUSH socket to the client's reply endpoint, builds the
core (and runs its warm-up request), binds a PULL socket for requests and says
:class:`Ready` (or :class:`StartFailed`). Then the loop serves: it waits on the
request socket (and on signals and the parent process) only while the core has
nothing to do, applies every message that has arrived, runs one core step and
sends each output the step returned. Replies to admissions, status queries and
RPCs are therefore sent between steps.

The stage ends when the client sends :class:`Shutdown` or its process goes
away (exit code 0), the core dies (:data:`EXIT_DEAD`) or a signal arrives
(``128 + signum``); in the last two cases it first sends :class:`StageDead`,
so the client fails its pending calls at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import attrs
import zmq

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineCore, StepResult
from diffusion_runtime.errors import EngineDeadError, InvalidFieldError, RPCError, describe_error
from diffusion_runtime.executor.rpc_checks import checked_timeout
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.stage.adapter_calls import ADAPTER_CALLS, run_adapter_call
from diffusion_runtime.stage.allow_list import rpc_allow_list
from diffusion_runtime.stage.codec import error_to_msg, output_to_frames, params_from_msg
from diffusion_runtime.stage.endpoints import (
    DEFAULT_MAX_REPLY_BYTES,
    bind,
    remove_orphaned_socket_dir,
)
from diffusion_runtime.stage.errors import StageProtocolError
from diffusion_runtime.stage.messages import (
    Abort,
    AddRequest,
    AddRequests,
    Admitted,
    CollectiveRPC,
    FromStage,
    Pause,
    Profile,
    Ready,
    Resume,
    RPCResult,
    Shutdown,
    Sleep,
    StageDead,
    StartFailed,
    Status,
    StatusQuery,
    ToStage,
    WakeUp,
    decode_to_stage,
    encode,
    salvage_ids,
)
from diffusion_runtime.stage.security import CurveGuard, CurveIdentity, secure_sockets

logger = logging.getLogger(__name__)

EXIT_START_FAILED = 1
#: The core died (or the stage's own loop failed); :class:`StageDead` says why.
EXIT_DEAD = 2
#: A signal ends the stage with ``128 + signum``, as a shell reports it.
EXIT_SIGNAL_BASE = 128
#: How often an idle stage checks its executor (a step notices a dead one at once).
HEALTH_INTERVAL_S = 0.25
#: How long the last messages (StageDead, StartFailed) may wait for the client.
FINAL_LINGER_MS = 2_000
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@attrs.frozen
class StageSpec:
    """What the stage process is started with (pickled once, by ``spawn``).

    ``reply_endpoint`` is the client's bound PULL socket; ``request_address``
    is where the stage binds its own PULL socket; a request message larger
    than ``max_frame_bytes`` is dropped unread (a frame that large drops its
    sender), and images over ``max_reply_bytes`` are not sent. ``curve`` is
    the stage's CURVE credentials (TCP), None for IPC.
    """

    config: EngineConfig
    reply_endpoint: str
    request_address: str
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    curve: CurveIdentity | None = None


def run_stage(spec: StageSpec) -> None:
    """The process's entry point: serve, then exit with the stage's exit code."""
    for signum in _SIGNALS:
        signal.signal(signum, _exit_on_signal)
    try:
        code = StageProc(spec).run()
    finally:  # an orphaned stage removes its dead client's socket directory
        remove_orphaned_socket_dir(spec.request_address)
    sys.exit(code)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_SIGNAL_BASE + signum)


class StageProc:
    """Serves one core to one client. Every socket and file it opens is closed
    before :meth:`run` returns. It starts no thread of its own (over TCP, the
    CURVE guard runs ZMQ's authenticator thread until the stage ends)."""

    def __init__(self, spec: StageSpec) -> None:
        self._spec = spec
        self._core: EngineCore | None = None
        self._allowed: frozenset[str] = frozenset()
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PUSH)
        self._requests = self._ctx.socket(zmq.PULL)
        self._exit_code: int | None = None
        self._dead_reason: str | None = None
        self._signalled: int | None = None
        #: What the last step asked for (None before the first).
        self._last_step: StepResult | None = None
        self._guard: CurveGuard | None = None

    @property
    def core(self) -> EngineCore:
        assert self._core is not None, "the core is built before serving starts"
        return self._core

    def run(self) -> int:
        """Start, serve, and return the exit code."""
        try:
            spec = self._spec
            self._guard = secure_sockets(
                self._ctx, self._requests, self._replies, spec.max_frame_bytes, spec.curve
            )
            self._replies.connect(self._spec.reply_endpoint)
            try:
                self._core = EngineCore(self._spec.config)
                if self._spec.config.warmup:
                    self._core.warm_up()
                self._allowed = rpc_allow_list(self._spec.config)
                endpoint = bind(self._requests, self._spec.request_address)
            except Exception as exc:
                logger.exception("the stage failed to start")
                tb = "".join(traceback.format_exception(exc))
                self._send(StartFailed(describe_error(exc), tb))
                return EXIT_START_FAILED
            self._send(Ready(os.getpid(), endpoint, sorted(self._allowed)))
            return self._serve()
        finally:
            self._close()

    def _close(self) -> None:
        try:
            if self._core is not None:
                self._core.shutdown("the stage stopped")
        finally:
            self._requests.close(linger=0)
            self._replies.close(linger=FINAL_LINGER_MS)
            if self._guard is not None:
                self._guard.close()
            self._ctx.term()

    # -- the loop ------------------------------------------------------------------------

    def _serve(self) -> int:
        # A signal writes to this socket pair, so a wait on the poller ends at once.
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        previous_wakeup_fd = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        for signum in _SIGNALS:
            signal.signal(signum, self._on_signal)
        poller = zmq.Poller()
        poller.register(self._requests, zmq.POLLIN)
        poller.register(wake_read, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        try:
            while self._exit_code is None:
                ready = dict(poller.poll(self._wait_ms()))
                if wake_read in ready:
                    _drain_socket(wake_read)
                if parent is not None and parent.sentinel in ready:
                    logger.warning("the client process is gone; the stage stops")
                    self._finish(0)
                self._serve_once(idle=not ready)
        finally:
            for signum in _SIGNALS:
                signal.signal(signum, _exit_on_signal)
            signal.set_wakeup_fd(previous_wakeup_fd)
            wake_read.close()
            wake_write.close()
        if self._dead_reason is not None:
            self._send(StageDead(self._dead_reason))
        assert self._exit_code is not None
        return self._exit_code

    def _wait_ms(self) -> int:
        """How long the loop may wait for a message: as long as the last step allows
        (not at all while the core has work), at most a health interval."""
        if self._signalled is not None:
            return 0
        core = self.core
        wait = None if self._last_step is None else self._last_step.wait_s(core.clock())
        if core.has_input():
            wait = 0.0
        return int(min(HEALTH_INTERVAL_S, HEALTH_INTERVAL_S if wait is None else wait) * 1000)

    def _serve_once(self, idle: bool) -> None:
        if self._signalled is not None:
            name = signal.Signals(self._signalled).name
            self._fail(f"the stage was stopped by {name}", EXIT_SIGNAL_BASE + self._signalled)
            return
        try:
            self._take_messages()
            if self._exit_code is not None:
                return
            if self.core.has_unfinished():
                self._last_step = self.core.step()
                for output in self._last_step.outputs:
                    self._send_output(output)
            elif idle:  # notice a dead executor while no step runs to report it
                self.core.check_health()
        except EngineDeadError as exc:
            self._fail(str(exc))
        except Exception as exc:
            logger.exception("the stage's loop failed")
            self._fail(f"the stage's loop failed: {describe_error(exc)}")

    def _finish(self, code: int) -> None:
        if self._exit_code is None:
            self._exit_code = code

    def _fail(self, reason: str, code: int = EXIT_DEAD) -> None:
        """The stage cannot serve any more: tell the client why, then exit with ``code``."""
        if self._dead_reason is None:
            logger.error("the stage is dead: %s", reason)
            self._dead_reason = reason
        self._finish(code)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = signum  # the loop acts on it once the current step ends

    def _send(self, message: FromStage, payloads: Sequence[memoryview] = ()) -> None:
        frames: list[bytes | memoryview] = [encode(message), *payloads]
        self._replies.send_multipart(frames, copy=False)

    def _send_output(self, output: RequestOutput) -> None:
        result, payloads = output_to_frames(output, self._spec.max_reply_bytes)
        self._send(result, payloads)

    # -- messages from the client ----------------------------------------------------------

    def _take_messages(self) -> None:
        """Apply every message that has arrived, in order."""
        while self._exit_code is None:
            message = self._receive()
            if message is None:
                return
            self._apply(message)

    def _receive(self) -> ToStage | None:
        """The next readable message, or None when none has arrived; unreadable ones
        are refused (or dropped) here."""
        while True:
            try:
                frames = self._requests.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            message = self._read(frames)
            if message is not None:
                return message

    def _read(self, frames: list[zmq.Frame]) -> ToStage | None:
        size = sum(len(frame) for frame in frames)
        if size > self._spec.max_frame_bytes:
            logger.warning("dropped a %d-byte message (limit %d)", size, self._spec.max_frame_bytes)
            return None
        header = frames[0].buffer
        try:
            message = decode_to_stage(header)
        except Exception as exc:  # any decode failure: malformed, too deep, too large
            self._refuse(header, f"unreadable message: {exc}")
            return None
        if len(frames) > 1:
            self._refuse(header, f"a request is one frame; got {len(frames)}")
            return None
        return message

    def _refuse(self, header: memoryview, reason: str) -> None:
        request_id, call_id = salvage_ids(header)
        if request_id is None and call_id is None:
            logger.warning("dropped a message: %s", reason)
            return
        self._send(error_to_msg(StageProtocolError(reason), request_id, call_id))

    def _apply(self, message: ToStage) -> None:
        if isinstance(message, AddRequest):
            self._add_request(message)
        elif isinstance(message, AddRequests):
            self._add_requests(message)
        elif isinstance(message, Abort):
            self.core.abort(message.request_ids, message.reason)
        elif isinstance(message, Pause):
            self.core.pause()
        elif isinstance(message, Resume):
            self.core.resume()
        elif isinstance(message, CollectiveRPC):
            self._collective_rpc(message)
        elif isinstance(message, StatusQuery):
            self._status(message)
        elif isinstance(message, Sleep):
            self._operate(message.call_id, lambda: self.core.sleep(message.level))
        elif isinstance(message, WakeUp):
            self._operate(message.call_id, self.core.wake_up)
        elif isinstance(message, Profile):
            if message.is_start:
                self._operate(message.call_id, lambda: self.core.start_profile(message.prefix))
            else:
                self._operate(message.call_id, self.core.stop_profile)
        elif isinstance(message, Shutdown):
            self._finish(0)

    def _add_request(self, message: AddRequest) -> None:
        core = self.core
        try:
            params = params_from_msg(message.params)
            core.validate(message.prompt, params)
            core.add_request(message.request_id, message.prompt, params, message.seed)
        except EngineDeadError:
            raise
        except Exception as exc:
            self._send(error_to_msg(exc, request_id=message.request_id))
            return
        self._send(Admitted(message.request_id))

    def _add_requests(self, message: AddRequests) -> None:
        """Admit every request of the message, or none."""
        core = self.core
        admitted: list[str] = []
        try:
            count = len(message.prompts)
            if not count:
                raise InvalidFieldError("AddRequests", "prompts", "must not be empty", [])
            for field, values in (("child_ids", message.child_ids), ("seeds", message.seeds)):
                if len(values) != count:
                    rule = f"must have one item per prompt ({count})"
                    raise InvalidFieldError("AddRequests", field, rule, len(values))
            params = params_from_msg(message.params)
            for prompt in message.prompts:
                core.validate(prompt, params)
            for child_id, prompt, seed in zip(
                message.child_ids, message.prompts, message.seeds, strict=True
            ):
                core.add_request(child_id, prompt, params, seed)
                admitted.append(child_id)
        except EngineDeadError:
            raise
        except Exception as exc:
            core.abort(admitted, "a request admitted with it was refused")
            self._send(error_to_msg(exc, request_id=message.request_id))
            return
        self._send(Admitted(message.request_id))

    # -- control ---------------------------------------------------------------------------

    def _collective_rpc(self, message: CollectiveRPC) -> None:
        """Run an allow-listed worker method between two steps and send its reply."""
        call_id = message.call_id
        if message.method in ADAPTER_CALLS:
            self._operate(
                message.call_id,
                lambda: run_adapter_call(self.core, message.method, message.args),
            )
            return
        if message.method not in self._allowed:
            refusal = RPCError(
                f"method {message.method!r} is not on the stage's RPC allow-list: "
                f"{sorted(self._allowed)}"
            )
            self._send(error_to_msg(refusal, call_id=call_id))
            return
        try:
            value = self.core.collective_rpc(
                message.method,
                tuple(message.args),
                message.kwargs,
                checked_timeout(message.timeout),
                message.unique_reply_rank,
            )
        except Exception as exc:
            self._send(error_to_msg(exc, call_id=call_id))
            if isinstance(exc, EngineDeadError):
                raise
            return
        try:
            frame = encode(RPCResult(call_id, value))
        except TypeError as exc:
            refusal = RPCError(f"the reply of {message.method!r} cannot cross as msgpack: {exc}")
            self._send(error_to_msg(refusal, call_id=call_id))
            return
        if len(frame) > self._spec.max_reply_bytes:  # the client would drop this connection
            refusal = RPCError(
                f"the reply of {message.method!r} is {len(frame)} bytes, over the client's "
                f"max_reply_bytes ({self._spec.max_reply_bytes})"
            )
            self._send(error_to_msg(refusal, call_id=call_id))
            return
        self._replies.send(frame)

    def _operate(self, call_id: int, call: Callable[[], Any]) -> None:
        """Run an operator's call on the core (adapters, sleep, wake, profile) and reply."""
        try:
            value = call()
        except Exception as exc:
            self._send(error_to_msg(exc, call_id=call_id))
            if isinstance(exc, EngineDeadError):
                raise
            return
        self._send(RPCResult(call_id, value))

    def _status(self, message: StatusQuery) -> None:
        error = None
        try:
            self.core.check_health()
        except EngineDeadError as exc:
            error = str(exc)
        self._send(Status(message.call_id, error is None, error, self.core.queue_length))
        if error is not None:
            self._fail(error)


def _drain_socket(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass
