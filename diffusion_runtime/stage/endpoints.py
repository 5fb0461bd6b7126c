"""Where the stage's two sockets live, and the limits every receiving socket enforces.

IPC sockets sit in a private directory whose name carries its owner's pid, so
a directory left by a killed owner is found and removed; TCP binds loopback
unless the caller opts into every interface.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import zmq

from diffusion_runtime.errors import InvalidFieldError

logger = logging.getLogger(__name__)

TRANSPORTS = ("ipc", "tcp")
LOOPBACK = "127.0.0.1"
#: Hosts that bind every interface of the machine.
ALL_INTERFACES = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
#: The largest frame the client accepts from its stage (an output's images).
DEFAULT_MAX_REPLY_BYTES = 1024**3
SOCKET_DIR_PREFIX = "diffusion-stage-"
_SOCKET_DIR_NAME = re.compile(rf"{SOCKET_DIR_PREFIX}(\d+)-")


class SocketDir:
    """A directory only this user can enter (mode 0700) holding the IPC socket files.

    Its name starts with ``diffusion-stage-<owner pid>-``. Its owner removes it,
    socket files and all, with :meth:`close` (idempotent); if the owner is killed
    first, its stage removes it on the way out (:func:`remove_orphaned_socket_dir`),
    or the next launch does (:func:`reap_stale_socket_dirs`).
    """

    def __init__(self) -> None:
        reap_stale_socket_dirs()
        self.path = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        os.chmod(self.path, 0o700)

    def endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def reap_stale_socket_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's socket directories whose owner process is gone; return them.

    A directory whose owner pid was reused by another process stays until that
    process ends too.
    """
    reaped = []
    for path in Path(parent or tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}*"):
        match = _SOCKET_DIR_NAME.match(path.name)
        try:
            owned = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if match is None or not owned or _is_alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        reaped.append(str(path))
    if reaped:
        logger.info("removed %d socket directories of stopped clients", len(reaped))
    return reaped


def remove_orphaned_socket_dir(request_address: str) -> None:
    """In the stage process: remove the socket directory of ``request_address`` if
    the client that made it (this process's parent) is gone."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.is_alive() or not request_address.startswith("ipc://"):
        return
    socket_dir = Path(request_address.removeprefix("ipc://")).parent
    if socket_dir.name.startswith(SOCKET_DIR_PREFIX):
        shutil.rmtree(socket_dir, ignore_errors=True)


def _is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def checked_host(host: object, allow_all_interfaces: bool) -> str:
    """``host`` if it is a string naming one interface, or every interface with the opt-in.

    Binding every interface logs a warning even when opted into.
    """
    if not isinstance(host, str):
        raise InvalidFieldError("StageClient", "host", "must be a str", host)
    if host.strip() in ALL_INTERFACES:
        if not allow_all_interfaces:
            raise InvalidFieldError(
                "StageClient",
                "host",
                "binds every interface; pass allow_all_interfaces=True to opt in",
                host,
            )
        logger.warning(
            "the stage binds every interface (host %r): any machine that reaches its ports "
            "can try to connect; only CURVE-authenticated peers are served",
            host,
        )
    return host


def checked_frame_limit(field: str, value: object) -> int:
    """``value`` if it is an int in [1, 2**63): a frame limit in bytes."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**63:
        raise InvalidFieldError("StageClient", field, "must be an int in [1, 2**63) bytes", value)
    return value


def bind_address(transport: str, host: str, socket_dir: SocketDir | None, name: str) -> str:
    """The address to bind socket ``name`` to: a file in ``socket_dir`` for ``"ipc"``,
    an ephemeral port on ``host`` for ``"tcp"``."""
    if transport == "ipc":
        if socket_dir is None:
            raise ValueError("an ipc endpoint needs a socket directory")
        return socket_dir.endpoint(name)
    if transport == "tcp":
        return f"tcp://[{host}]:*" if ":" in host else f"tcp://{host}:*"
    raise ValueError(f"transport must be one of {TRANSPORTS}; got {transport!r}")


def limit_inbound(socket: zmq.Socket[Any], max_frame_bytes: int) -> None:
    """Refuse frames over ``max_frame_bytes`` as their header arrives, before any
    of their bytes are buffered: zmq drops the peer that sent one."""
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)


def bind(socket: zmq.Socket[Any], address: str) -> str:
    """Bind ``socket`` and return the endpoint peers connect to (with the port chosen)."""
    socket.bind(address)
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
