"""Errors the runtime raises to its callers."""

from __future__ import annotations

import reprlib

#: The longest echo of a bad value in an error message.
MAX_VALUE_REPR = 200
#: Integers with more bits are described by their size (``repr`` of a huge int is slow or fails).
_MAX_INT_BITS = 512

_short_repr = reprlib.Repr()
_short_repr.maxlevel = 3
_short_repr.maxstring = MAX_VALUE_REPR
_short_repr.maxother = MAX_VALUE_REPR
_short_repr.maxlong = MAX_VALUE_REPR


def describe_value(value: object, limit: int = MAX_VALUE_REPR) -> str:
    """A ``repr`` of ``value`` cut to about ``limit`` characters, for error messages.

    Never raises: a huge int is described by its size, deep nesting is elided,
    and an object whose ``repr`` fails is named by its type.
    """
    try:
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            text = f"<int of {value.bit_length()} bits>"
        else:
            text = _short_repr.repr(value)
    except Exception:
        text = f"<{type(value).__name__} whose repr failed>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


class DiffusionRuntimeError(Exception):
    """Base class of the runtime's own errors."""


class InvalidFieldError(DiffusionRuntimeError, ValueError):
    """A configuration or request field broke a rule.

    The message names the owner, the field, the rule and the offending value
    (its ``repr`` cut to :data:`MAX_VALUE_REPR` characters); ``value`` keeps
    the value itself.
    """

    def __init__(self, owner: str, field: str, rule: str, value: object) -> None:
        self.owner = owner
        self.field = field
        self.rule = rule
        self.value = value
        super().__init__(f"{owner}.{field} {rule}; got {describe_value(value)}")


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


class CollectiveFault(DeviceFault):
    """A collective between the ranks that share one model failed: a peer died, or
    hung past the group's timeout. The group is broken, so the executor fails."""


class RPCError(DiffusionRuntimeError):
    """A collective RPC was refused, failed on a worker or timed out."""


class LoRAError(DiffusionRuntimeError):
    """An adapter call was refused: the adapter is in use, there is no room for
    it, its file does not fit, or the engine runs without adapters."""


class PipelineContractError(DiffusionRuntimeError):
    """A pipeline lacks what the configured execution mode needs."""


class SleepStateError(DiffusionRuntimeError):
    """``sleep`` or ``wake_up`` came in the wrong order: ``wake_up`` while awake,
    ``sleep`` while asleep, or a wave sent to a sleeping worker."""


class ProfilingError(DiffusionRuntimeError):
    """A profiling call was refused: no ``EngineConfig.profile_dir``, a bad prefix,
    ``start_profile`` while profiling or ``stop_profile`` while not."""


def describe_error(exc: BaseException) -> str:
    """How an exception is reported to a caller in one line: its type and message."""
    return f"{type(exc).__name__}: {exc}"
