"""Running the app under uvicorn: in the foreground (``serve``) or on a background thread."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.serving.app import build_app, served_model_name
from diffusion_runtime.serving.config import ServerConfig

#: Seconds that requests in flight get to finish once the server is told to stop.
SHUTDOWN_GRACE_S = 5


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this; without it a small answer can wait
        # ~40 ms for the client's delayed ACK (Nagle's algorithm).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Start an engine, serve it over HTTP until interrupted, then close it.

    ``access_log`` logs a line per request (off by default: it costs every
    request CPU time on the event loop that serves them all)."""
    server_config = server_config if server_config is not None else ServerConfig()
    with DiffusionEngine.make_engine(engine_config) as engine:
        app = build_app(engine, server_config)
        # Also sets up uvicorn's logging. Requests still running after the grace
        # period are cancelled, which aborts them in the engine.
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        with bound_socket(host, port) as sock:
            logging.getLogger("uvicorn.error").info(
                "serving model %r at %s (POST /v1/images/generations, GET /metrics)",
                served_model_name(engine, server_config),
                url_of(sock),
            )
            with (
                _sigterm_as_interrupt(),
                _startup_objects_frozen(),
                contextlib.suppress(KeyboardInterrupt),
            ):
                # uvicorn shuts down gracefully, then raises the signal again.
                uvicorn.Server(config).run(sockets=[sock])


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Make SIGTERM end the server like Ctrl-C, so the engine is closed on the way out."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _startup_objects_frozen() -> Iterator[None]:
    """Keep the garbage collector's full collections off what start-up built.

    The modules, the model and the app live as long as the server; walking
    them in a full collection stopped the event loop for about 60 ms under
    load (the p99 of ``bench http``). Frozen, a full collection walks only
    what was made since.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class ServerThread:
    """Serves an app with uvicorn on a background thread (tests, benchmarks, notebooks).

    Binds ``host:port`` at once (``port=0``: a free port, read back from
    :attr:`url`), starts serving on :meth:`start` and stops, waiting for the
    thread and closing the socket, on :meth:`close` or at the end of a
    ``with`` block.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = bound_socket(host, port)
        self.url = url_of(self._socket)
        self._server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="uvicorn-server"
        )

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        """Start serving; return once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting (see its log)")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the server did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Stop serving (the app's lifespan ends) and release the thread and socket."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
