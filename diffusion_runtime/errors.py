"""Errors the runtime raises to its callers."""

from __future__ import annotations


class DiffusionRuntimeError(Exception):
    """Base class of the runtime's own errors."""


class InvalidFieldError(DiffusionRuntimeError, ValueError):
    """A configuration or request field broke a rule.

    The message names the owner, the field, the rule and the offending value.
    """

    def __init__(self, owner: str, field: str, rule: str, value: object) -> None:
        self.owner = owner
        self.field = field
        self.rule = rule
        self.value = value
        super().__init__(f"{owner}.{field} {rule}; got {value!r}")


class DuplicateRequestError(DiffusionRuntimeError, ValueError):
    """A request id is already in use by an active request."""


class QueueFullError(DiffusionRuntimeError):
    """The engine's waiting queue is at ``max_waiting_requests``."""


class EngineClosedError(DiffusionRuntimeError):
    """The engine was closed; it accepts no requests and ends every open stream."""


class EngineDeadError(DiffusionRuntimeError):
    """The executor failed for good (a dead worker, a sticky device fault)."""


class DeviceFault(DiffusionRuntimeError):
    """Raised by a pipeline or worker for a fault that poisons the device.

    Unlike an ordinary exception, which fails only the requests of its wave, a
    device fault marks the executor failed and the engine dead.
    """


class RPCError(DiffusionRuntimeError):
    """A collective RPC was refused, failed on a worker or timed out."""


class PipelineContractError(DiffusionRuntimeError):
    """A pipeline lacks what the configured execution mode needs."""


def describe_error(exc: BaseException) -> str:
    """How an exception is reported to a caller in one line: its type and message."""
    return f"{type(exc).__name__}: {exc}"
