"""CURVE authentication of the stage's TCP sockets, and the frame limit of its receivers.

Each launch makes two fresh key pairs, one for the client and one for the
stage. The stage's half (its key pair and the client's public key) travels in
the spawn arguments, never over a socket. Each side binds its receiving
socket as a CURVE server whose ZAP handler admits only the other side's
public key, and connects its sending socket as a CURVE client that trusts
only the other side's server key: both directions are authenticated and
encrypted, and a peer without the launch's keys never gets a message through.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import attrs
import zmq
from zmq.auth.thread import ThreadAuthenticator

from diffusion_runtime.stage.endpoints import limit_inbound

logger = logging.getLogger(__name__)


@attrs.frozen
class CurveKeyPair:
    """A CURVE key pair, both keys Z85-encoded (40 bytes)."""

    public: bytes
    secret: bytes = attrs.field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


@attrs.frozen
class CurveIdentity:
    """One side's credentials: its own key pair and the one peer key it accepts."""

    own: CurveKeyPair
    peer_public: bytes


def launch_identities() -> tuple[CurveIdentity, CurveIdentity]:
    """Fresh credentials for one launch: ``(client's, stage's)``."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; the stage cannot use TCP")
    client, stage = CurveKeyPair.generate(), CurveKeyPair.generate()
    return CurveIdentity(client, stage.public), CurveIdentity(stage, client.public)


class _OnePeer:
    """The ZAP credentials check: only the peer's public key passes."""

    def __init__(self, peer_public: bytes) -> None:
        self._peer_public = peer_public

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self._peer_public):
            return True
        logger.warning("refused a connection from a peer without this stage's keys")
        return False


class CurveGuard:
    """Owns the ZAP handler thread of one ZMQ context; :meth:`close` stops it
    (idempotent), and must run before the context is terminated."""

    def __init__(self, ctx: zmq.Context[Any], peer_public: bytes) -> None:
        self._authenticator: ThreadAuthenticator | None = ThreadAuthenticator(ctx)
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", _OnePeer(peer_public))

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def serve_only_peer(
    ctx: zmq.Context[Any], receiver: zmq.Socket[Any], identity: CurveIdentity
) -> CurveGuard:
    """Make ``receiver`` (before it binds) a CURVE server that admits only the peer's key."""
    guard = CurveGuard(ctx, identity.peer_public)
    receiver.curve_server = True
    receiver.curve_secretkey = identity.own.secret
    return guard


def trust_only_peer(sender: zmq.Socket[Any], identity: CurveIdentity) -> None:
    """Make ``sender`` (before it connects) a CURVE client of the peer's server key."""
    sender.curve_publickey = identity.own.public
    sender.curve_secretkey = identity.own.secret
    sender.curve_serverkey = identity.peer_public


def secure_sockets(
    ctx: zmq.Context[Any],
    receiver: zmq.Socket[Any],
    sender: zmq.Socket[Any],
    max_frame_bytes: int,
    identity: CurveIdentity | None,
) -> CurveGuard | None:
    """Prepare one side's sockets before the receiver binds and the sender connects.

    The receiver refuses frames over ``max_frame_bytes``. With ``identity``
    (TCP), the receiver serves only the peer's key and the sender trusts only
    the peer's server key; the returned guard is the caller's to close.
    """
    limit_inbound(receiver, max_frame_bytes)
    if identity is None:
        return None
    trust_only_peer(sender, identity)
    return serve_only_peer(ctx, receiver, identity)
