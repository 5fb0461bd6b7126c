"""The request machine as a Mermaid state diagram, read back from the live machine.

``python -m diffusion_runtime.fsm.diagram`` prints it; ``docs/architecture.md``
embeds the output, and a test fails when the two differ.
"""

from __future__ import annotations

from diffusion_runtime.fsm.machine import ENTRY_HOOKS, INITIAL_STATE, RequestMachine
from diffusion_runtime.fsm.states import TERMINAL_STATES, RequestStatus


def mermaid_state_diagram() -> str:
    """Every legal move of the machine, plus the hook group each state's entry runs."""
    lines = ["stateDiagram-v2", f"    [*] --> {INITIAL_STATE.value}: admit"]
    for source, trigger, dest in RequestMachine().legal_moves():
        lines.append(f"    {source.value} --> {dest.value}: {trigger.value}")
    for state in RequestStatus:
        if state in TERMINAL_STATES:
            lines.append(f"    {state.value} --> [*]")
    for state in RequestStatus:
        lines.append(f"    note right of {state.value}: on enter, {ENTRY_HOOKS[state].value} hooks")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(mermaid_state_diagram(), end="")
