"""The adapter calls a stage client may make: core calls, not worker methods.

``add_lora``, ``remove_lora``, ``list_loras`` and ``pin_lora`` travel as
collective RPC messages, but the stage runs them on its core (which keeps the
adapter table and the all-or-nothing add), never straight on the workers. A
:class:`~diffusion_runtime.LoRARequest` crosses as a ``LoRARequestMsg``.
"""

from __future__ import annotations

from typing import Any

from diffusion_runtime.core import EngineCore
from diffusion_runtime.errors import RPCError
from diffusion_runtime.lora_request import LoRARequest

ADAPTER_CALLS = frozenset({"add_lora", "remove_lora", "list_loras", "pin_lora"})


def run_adapter_call(core: EngineCore, method: str, args: list[Any]) -> Any:
    """Run one adapter call on ``core`` with the arguments as they crossed."""
    if method == "list_loras" and not args:
        return core.list_loras()
    if len(args) != 1:
        raise RPCError(f"{method} takes one argument; got {len(args)}")
    [arg] = args
    if method == "add_lora":
        if not isinstance(arg, dict):
            raise RPCError(f"add_lora takes a LoRARequestMsg; got {type(arg).__name__}")
        return core.add_lora(LoRARequest(**arg))
    if method == "remove_lora":
        return core.remove_lora(arg)
    if method == "pin_lora":
        return core.pin_lora(arg)
    raise RPCError(f"{method} is not an adapter call")
