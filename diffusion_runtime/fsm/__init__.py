"""The request lifecycle: states, the transition table, events and hooks.

This package imports nothing else from ``diffusion_runtime``.
"""

from diffusion_runtime.fsm.events import ADMIT, LifecycleEvent
from diffusion_runtime.fsm.machine import (
    ENTRY_HOOKS,
    TRANSITION_TABLE,
    Hook,
    LifecycleViolation,
    RequestLifecycle,
    RequestMachine,
    Trigger,
)
from diffusion_runtime.fsm.states import (
    DEADLINE_REASON,
    STARTED_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    RequestStatus,
)

__all__ = [
    "ADMIT",
    "DEADLINE_REASON",
    "ENTRY_HOOKS",
    "STARTED_STATES",
    "TERMINAL_STATES",
    "TRANSITION_TABLE",
    "WAITING_STATES",
    "Hook",
    "LifecycleEvent",
    "LifecycleViolation",
    "RequestLifecycle",
    "RequestMachine",
    "RequestStatus",
    "Trigger",
]
