"""RunnerOutput: what a wave produced, keyed by request id."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(slots=True)
class RunnerOutput:
    """Per-request results of one scheduler output.

    ``images`` maps a request id to its CPU image tensor
    ``(num_outputs, C, H, W)``; ``errors`` maps a request id to why it failed.
    A request id appears in at most one of them; a scheduled id in neither is a
    missing result. In step mode, ``progress`` maps each stepped request to
    ``(step_index, num_steps)`` after the step, ``images`` holds only requests
    that finished their last step, and ``previews`` holds intermediate images.
    ``executed`` lists the ids handed to the pipeline, in order; ``created`` and
    ``released`` the ids whose runner state was created or dropped (the trace
    and the auditor check them against the scheduler's output).
    """

    wave_id: int
    images: dict[str, torch.Tensor] = attrs.field(factory=dict)
    errors: dict[str, str] = attrs.field(factory=dict)
    progress: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    previews: dict[str, torch.Tensor] = attrs.field(factory=dict)
    executed: list[str] = attrs.field(factory=list)
    created: list[str] = attrs.field(factory=list)
    released: list[str] = attrs.field(factory=list)

    @classmethod
    def failed(cls, wave_id: int, request_ids: tuple[str, ...], message: str) -> RunnerOutput:
        """Every listed request failed with the same message."""
        return cls(wave_id, {}, dict.fromkeys(request_ids, message))
