"""First-block cache decided per request: skip the later blocks while the first block's
residual barely moved.

Each request's :class:`FirstBlockCacheState` lives in its own
:class:`~diffusion_runtime.pipelines.protocols.StepRequestState` and is fed only
that request's rows, so a request skips the same steps whatever it is batched
with. See ``docs/caching.md``.
"""

from __future__ import annotations

import attrs
import torch

from diffusion_runtime.cache_settings import CacheSettings
from diffusion_runtime.pipelines.step_cache import relative_l1


@attrs.define(eq=False)
class FirstBlockCacheState:
    """One request's cache: the first block's residual at the last step that ran
    every block (what a step is compared with), and the later blocks' residual
    at that step (what a skipping step adds instead of running them)."""

    settings: CacheSettings
    first_residual: torch.Tensor | None = None
    later_residual: torch.Tensor | None = None
    skips_in_row: int = 0

    def skips(self, first_residual: torch.Tensor, step_index: int, num_steps: int) -> bool:
        """Whether step ``step_index``, whose first block left ``first_residual``,
        adds :attr:`later_residual` instead of running the later blocks."""
        settings = self.settings
        forced = (
            self.first_residual is None
            or self.later_residual is None
            or step_index < settings.warmup_steps
            or step_index == num_steps - 1
            or self.skips_in_row == settings.max_consecutive_skips
        )
        if not forced:
            assert self.first_residual is not None
            if relative_l1(first_residual, self.first_residual) < settings.rel_l1_thresh:
                self.skips_in_row += 1
                return True
        self.skips_in_row = 0
        return False

    def remember(self, first_residual: torch.Tensor, later_residual: torch.Tensor) -> None:
        """Keep a step that ran every block (copies this request owns)."""
        self.first_residual = first_residual.clone()
        self.later_residual = later_residual.clone()
