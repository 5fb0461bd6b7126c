"""Pipelines and helpers that the mp, Ray and liveness executor tests share.

Workers import the pipelines by this module's name (the tests' folder is on
their path), so they live here rather than in a test module.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineCore
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepRequestState
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline, SeededNoisePipeline


class GatedPipeline(FaultInjectingPipeline):
    """Leaves a file in ``flag_dir`` when a "gate" forward starts (one per process)."""

    def __init__(self, device: Any = "cpu", flag_dir: str = "") -> None:
        super().__init__(device)
        self.flag_dir = flag_dir

    def forward(self, batch: Sequence[PipelineRequest]) -> Any:
        if any("gate" in str(request.prompt) for request in batch):
            Path(self.flag_dir, f"entered-{os.getpid()}").touch()
        return super().forward(batch)


class PreviewingNoise(SeededNoisePipeline):
    """The noise pipeline with streaming previews."""

    def preview(self, state: StepRequestState) -> torch.Tensor:
        return torch.sigmoid(state.latents)


@contextlib.contextmanager
def audited_core(config: EngineConfig, **core_kwargs: Any) -> Iterator[EngineCore]:
    """A core on ``config`` (``core_kwargs`` go to :class:`EngineCore`), shut down on
    leaving; once shut down, its auditor (``audit="raise"``) holds no violation."""
    core = EngineCore(config, **core_kwargs)
    try:
        yield core
    finally:
        core.shutdown()
    assert core.auditor is not None and core.auditor.violations == []


def drain(core: EngineCore) -> dict[str, RequestOutput]:
    """Step ``core`` until it has nothing left; the final output of each request."""
    finals = {}
    while core.has_unfinished():
        finals.update({o.request_id: o for o in core.step().outputs if o.finished})
    return finals


def run_in_thread(fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Run ``fn`` on a daemon thread; its result or exception lands in the future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def body() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=body, daemon=True).start()
    return future


# Deeper than pickling can recurse; the input bounds count each link as one item.
DEEPER_THAN_PICKLE = 100_000


@attrs.define
class Link:
    """One link of a chain nested ``depth`` deep."""

    inner: Link | None


def chain(depth: int) -> Link | None:
    link = None
    for _ in range(depth):
        link = Link(link)
    return link
