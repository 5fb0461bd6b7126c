"""Per-client admission: at most ``limit`` requests in flight per client."""

from __future__ import annotations

from collections.abc import Callable

from diffusion_runtime.serving.errors import too_many_requests


class ClientLimiter:
    """Counts each client's requests in flight and refuses one beyond ``limit`` (429).

    Runs on the server's event loop only, so it needs no lock. ``limit=None``
    admits everything. A client is its OpenAI ``user`` field, else its address.
    """

    def __init__(self, limit: int | None, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self._in_flight: dict[str, int] = {}

    def acquire(self, client: str) -> None:
        """Take one of ``client``'s slots, or raise a 429 if none is free."""
        held = self._in_flight.get(client, 0)
        if self.limit is not None and held >= self.limit:
            raise too_many_requests(
                f"client {client!r} already has {held} requests in flight "
                f"(the limit is {self.limit})",
                "client_limit",
                self.retry_after_s,
            )
        self._in_flight[client] = held + 1

    def release(self, client: str) -> None:
        """Give back a slot taken with :meth:`acquire`."""
        remaining = self._in_flight[client] - 1
        if remaining:
            self._in_flight[client] = remaining
        else:
            del self._in_flight[client]

    def releaser(self, client: str) -> Callable[[], None]:
        """A function that gives back one of ``client``'s slots the first time it is
        called and does nothing after: for an exchange that may end on two paths."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.release(client)

        return release
