"""Joining a Ray cluster, or starting a local one that the executors of this process share."""

from __future__ import annotations

import threading

import ray


class RayConnection:
    """This process's use of Ray, counted by executor.

    An executor calls :meth:`acquire` when it starts and :meth:`release` when
    it shuts down. Ray that this process had already initialised is left alone;
    Ray that the first :meth:`acquire` initialised (a local instance, or a
    connection to ``address``) is shut down when the last executor releases it.
    """

    _lock = threading.Lock()
    _users = 0
    _owned = False

    @classmethod
    def acquire(cls, address: str | None) -> None:
        with cls._lock:
            if cls._users == 0 and not ray.is_initialized():
                ray.init(address=address, include_dashboard=False)
                cls._owned = True
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and cls._owned:
                cls._owned = False
                ray.shutdown()
