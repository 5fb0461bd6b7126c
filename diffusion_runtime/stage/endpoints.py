"""Where the stage's two sockets live: a private directory for IPC, loopback for TCP."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import zmq

TRANSPORTS = ("ipc", "tcp")
LOOPBACK = "127.0.0.1"


class SocketDir:
    """A directory only this user can enter (mode 0700) holding the IPC socket files.

    Its owner removes it, socket files and all, with :meth:`close` (idempotent).
    """

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="diffusion-stage-")
        os.chmod(self.path, 0o700)

    def endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


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


def bind(socket: zmq.Socket[Any], address: str) -> str:
    """Bind ``socket`` and return the endpoint peers connect to (with the port chosen)."""
    socket.bind(address)
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
