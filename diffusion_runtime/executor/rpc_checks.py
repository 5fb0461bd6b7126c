"""Checks of ``collective_rpc`` arguments, shared by every built-in executor."""

from __future__ import annotations

from diffusion_runtime.errors import InvalidFieldError, RPCError, describe_value

_OWNER = "collective_rpc"
_NO_LIMIT_S = 1e9


def checked_method(method: object) -> str:
    """``method`` if it names a method; RPCs are called by name only."""
    if not isinstance(method, str):
        raise RPCError(
            f"collective_rpc method must be a method name (str); got {describe_value(method)}"
        )
    return method


def checked_timeout(timeout: object, owner: str = _OWNER) -> float | None:
    """Seconds to wait, or None for no limit (``owner`` names the call in errors).

    ``None`` and ``inf`` mean no limit, and so do limits of 10⁹ s (about 31
    years) or more, which a thread wait may refuse. ``nan``, negatives, zero
    and non-numbers are refused.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidFieldError(owner, "timeout", "must be a number of seconds or None", timeout)
    if not timeout > 0:  # also refuses nan
        raise InvalidFieldError(
            owner, "timeout", "must be a positive number of seconds, inf or None", timeout
        )
    return float(timeout) if timeout < _NO_LIMIT_S else None


def checked_reply_rank(rank: object, num_workers: int) -> int | None:
    """``rank`` if it names an existing worker (an int, not a bool), or None."""
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_workers:
        raise RPCError(
            f"unique_reply_rank {describe_value(rank)} does not exist ({num_workers} workers)"
        )
    return rank
