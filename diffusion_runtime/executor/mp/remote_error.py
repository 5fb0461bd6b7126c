"""Carrying an exception from a worker process back to the caller, type and fields intact.

Plain pickling loses exceptions whose ``__init__`` takes more than the message
(``InvalidFieldError(owner, field, rule, value)`` cannot be rebuilt from its
``args``), and fails outright on unpicklable attributes. A :class:`RemoteError`
records the class by import path, the ``args`` and the instance attributes
that pickle, and the worker's traceback text; :meth:`RemoteError.rebuild`
makes an instance of the same class without calling its ``__init__``.
"""

from __future__ import annotations

import importlib
import pickle
import traceback
from typing import Any

import attrs

from diffusion_runtime.errors import RPCError


class WorkerTraceback(Exception):
    """The traceback of an error raised in a worker process (set as ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@attrs.frozen
class RemoteError:
    """An exception raised in worker ``rank``, in a form any process can rebuild."""

    rank: int
    module: str
    qualname: str
    message: str
    args: bytes
    state: bytes
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException, rank: int) -> RemoteError:
        kind = type(exc)
        return cls(
            rank=rank,
            module=kind.__module__,
            qualname=kind.__qualname__,
            message=str(exc),
            args=_dumps_or_repr(exc.args),
            state=pickle.dumps(
                {name: _picklable(value) for name, value in vars(exc).items()},
                pickle.HIGHEST_PROTOCOL,
            ),
            traceback="".join(traceback.format_exception(exc)),
        )

    @property
    def description(self) -> str:
        """``"Type: message"``, as the runtime describes errors elsewhere."""
        return f"{self.qualname}: {self.message}"

    def rebuild(self) -> Exception:
        """An instance of the original class; an :class:`RPCError` if it cannot be made here.

        Only ``Exception`` subclasses are rebuilt: a ``SystemExit`` or
        ``KeyboardInterrupt`` raised in a worker must not stop the caller.
        """
        exc: Exception
        try:
            kind: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                kind = getattr(kind, part)
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                raise TypeError(f"{self.qualname} is not an Exception subclass")
            exc = kind.__new__(kind)
            exc.args = pickle.loads(self.args)
            exc.__dict__.update(pickle.loads(self.state))
        except Exception:
            exc = RPCError(f"worker {self.rank} raised {self.description}")
        exc.__cause__ = WorkerTraceback(f"in worker {self.rank}:\n{self.traceback}")
        return exc


def _picklable(value: Any) -> Any:
    try:
        pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return repr(value)
    return value


def _dumps_or_repr(args: tuple[Any, ...]) -> bytes:
    return pickle.dumps(tuple(_picklable(arg) for arg in args), pickle.HIGHEST_PROTOCOL)
