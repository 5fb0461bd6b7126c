"""TeaCache decided per request: reuse its last model output while its input barely moved.

A batch in step mode holds requests at different steps, so one decision for
the whole batch would make a request's image depend on its batch mates. Here
each request's :class:`TeaCacheState` lives in its own
:class:`~diffusion_runtime.pipelines.protocols.StepRequestState` (so it goes with
the state through preemption and host offload, and is dropped with it) and is
fed only that request's tensors. See ``docs/caching.md``.
"""

from __future__ import annotations

import attrs
import torch

from diffusion_runtime.cache_settings import CacheSettings


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``sum|current - previous| / sum|previous|`` over one request's tensors (one
    read back to the host; ``inf`` or ``nan``, so never below a threshold, when
    ``previous`` is all zeros).

    The result depends only on the two tensors: their shapes are the request's
    own, whatever it is batched with, so every reduction runs the same way.
    """
    change = (current - previous).abs().sum()
    return float((change / previous.abs().sum()).item())


@attrs.define(eq=False)
class TeaCacheState:
    """One request's cache: the previous step's input signal, the change
    accumulated since the last computed step, and the last model output."""

    settings: CacheSettings
    signal: torch.Tensor | None = None
    accumulated: float = 0.0
    prediction: torch.Tensor | None = None
    skips_in_row: int = 0

    def reuses(self, signal: torch.Tensor, step_index: int, num_steps: int) -> bool:
        """Whether step ``step_index`` reuses :attr:`prediction`, given this step's
        input ``signal`` (kept for the next step's decision)."""
        settings = self.settings
        previous, self.signal = self.signal, signal
        forced = (
            previous is None
            or self.prediction is None
            or step_index < settings.warmup_steps
            or step_index == num_steps - 1
            or self.skips_in_row == settings.max_consecutive_skips
        )
        if not forced:
            assert previous is not None
            self.accumulated += relative_l1(signal, previous)
            if self.accumulated < settings.rel_l1_thresh:
                self.skips_in_row += 1
                return True
        self.accumulated = 0.0
        self.skips_in_row = 0
        return False


def tea_cache_for(settings: CacheSettings | None) -> TeaCacheState | None:
    """A fresh cache for a request whose settings pick TeaCache, else ``None``."""
    if settings is None or settings.backend != "tea_cache":
        return None
    return TeaCacheState(settings)
