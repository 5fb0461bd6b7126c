"""Ray's errors, told apart: a lost worker (fatal) from an error a worker method raised."""

from __future__ import annotations

from ray import exceptions as ray_errors

from diffusion_runtime.executor.mp.remote_error import RemoteError

# Errors meaning a worker actor, its node, or a result it produced is gone for good.
LOST_WORKER_ERRORS: tuple[type[BaseException], ...] = (
    ray_errors.RayActorError,  # ActorDiedError and ActorUnavailableError are subclasses
    ray_errors.ObjectLostError,  # OwnerDiedError and friends are subclasses
    ray_errors.NodeDiedError,
    ray_errors.WorkerCrashedError,
    ray_errors.LocalRayletDiedError,
)


class WorkerMethodError(Exception):
    """Carries an exception a worker method raised, in a form any process can rebuild.

    Ray pickles what an actor method raises; an exception whose ``__init__``
    takes more than its message (``InvalidFieldError``) would not unpickle.
    """

    def __init__(self, error: RemoteError) -> None:
        super().__init__(error.description)
        self.error = error

    def __reduce__(self) -> tuple[type[WorkerMethodError], tuple[RemoteError]]:
        return type(self), (self.error,)


def is_lost_worker(exc: BaseException) -> bool:
    return isinstance(exc, LOST_WORKER_ERRORS)


def remote_cause(exc: BaseException) -> BaseException:
    """The exception a worker method raised, rebuilt as its own type, or ``exc`` itself.

    Ray wraps what an actor method raises in a ``RayTaskError``; callers
    expect the original (a ``ValueError`` from request validation, an
    ``RPCError``).
    """
    cause = exc.cause if isinstance(exc, ray_errors.RayTaskError) else None
    if isinstance(cause, WorkerMethodError):
        return cause.error.rebuild()
    return cause if isinstance(cause, BaseException) else exc
