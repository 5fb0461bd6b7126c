"""Users' own components through the harness: broken ones are caught, sound ones pass.

Each broken pipeline here is plugged in only through the public extension
points (``EngineConfig(pipeline=...)``, ``scheduler_cls``) and run through the
default (core) harness as a user would run it.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch

from diffusion_runtime import EngineConfig
from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.pipelines.protocols import PipelineRequest, StepRequestState
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine, core_lifecycle_machine
from diffusion_runtime.testing.mutations import hunt
from diffusion_runtime.testing.pipelines import SeededNoisePipeline
from diffusion_runtime.testing.strategies import sampling_params

EXAMPLES = 60
ROOT = Path(__file__).parent.parent


class ResultsByPosition(SeededNoisePipeline):
    """Computes images in prompt order and hands them back in batch order."""

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        produced = super().forward(batch)
        ordered = sorted(batch, key=lambda r: str(r.prompt))
        return {
            request.request_id: produced[by_prompt.request_id]
            for request, by_prompt in zip(batch, ordered, strict=True)
        }


class CachesByPrompt(SeededNoisePipeline):
    """Caches a result per prompt and size: the seed is ignored after the first call."""

    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        cache: dict[Hashable, torch.Tensor] = self.__dict__.setdefault("cache", {})
        out = {}
        for request in batch:
            key = (str(request.prompt), request.params.num_outputs_per_prompt)
            if key not in cache:
                cache[key] = super().forward([request])[request.request_id]
            out[request.request_id] = cache[key]
        return out


class FailsEveryCall(SeededNoisePipeline):
    def forward(self, batch: Sequence[PipelineRequest]) -> Mapping[str, torch.Tensor]:
        raise RuntimeError("the model file is missing")


class KeepsEncodings(SeededNoisePipeline):
    """Step mode: remembers each request's encoding and never forgets it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.encodings: dict[str, torch.Tensor] = {}

    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        state = super().prepare_encode(request)
        self.encodings[request.request_id] = state.conditioning
        return state

    def held_request_ids(self) -> list[str]:
        return list(self.encodings)


class ReleasesEncodings(KeepsEncodings):
    """The same, but it drops an encoding when the runner releases the request."""

    def release_requests(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.encodings.pop(request_id, None)


class OverfullScheduler(RequestScheduler):
    """Fills every wave to twice ``max_num_seqs``."""

    def next_wave(self) -> list[Any]:
        key = next(iter(self.waiting.values())).batch_key if self.waiting else None
        wave = [r for r in self.waiting.values() if r.batch_key == key]
        return wave[: 2 * self.max_num_running_reqs]


def harness(pipeline: type, mode: str = "request", **options: Any) -> type[CoreLifecycleMachine]:
    return core_lifecycle_machine(
        lambda: EngineConfig(
            pipeline=pipeline, device="cpu", execution_mode=mode, max_num_seqs=3, warmup=False
        ),
        prompts=st.sampled_from(["x", "y", 3]),
        params=sampling_params(steps=(1, 3)),
        **options,
    )


@pytest.mark.parametrize(
    ("pipeline", "mode"),
    [
        (ResultsByPosition, "request"),
        (CachesByPrompt, "request"),
        (FailsEveryCall, "request"),
        (KeepsEncodings, "step"),
    ],
    ids=lambda p: getattr(p, "__name__", p),
)
def test_a_broken_pipeline_is_caught(pipeline: type, mode: str) -> None:
    assert hunt(None, harness(pipeline, mode), max_examples=EXAMPLES) is not None


def test_a_broken_scheduler_is_caught() -> None:
    machine = harness(SeededNoisePipeline, scheduler_cls=OverfullScheduler)
    assert hunt(None, machine, max_examples=EXAMPLES) is not None


@pytest.mark.parametrize("mode", ["request", "step"])
def test_a_sound_pipeline_that_releases_its_state_passes(mode: str) -> None:
    assert hunt(None, harness(ReleasesEncodings, mode), max_examples=EXAMPLES) is None


class Constant(SeededNoisePipeline):
    """Draws nothing at random: it declares that the seed does not matter."""

    seed_free = True

    def prepare_encode(self, request: PipelineRequest) -> StepRequestState:
        request._generator = torch.Generator().manual_seed(zlib.crc32(str(request.prompt).encode()))
        return super().prepare_encode(request)


def test_a_pipeline_that_declares_itself_seed_free_passes() -> None:
    assert hunt(None, harness(Constant), max_examples=EXAMPLES) is None


def docs_counting_executor() -> type[DiffusionExecutor]:
    text = (ROOT / "docs" / "executors.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "CountingExecutor" in b]
    namespace: dict[str, Any] = {}
    exec(block, namespace)
    executor: type[DiffusionExecutor] = namespace["CountingExecutor"]
    return executor


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_executors_guide_example_passes_the_harness(mode: str) -> None:
    machine = core_lifecycle_machine(
        lambda: EngineConfig(
            pipeline="testing-faults", device="cpu", execution_mode=mode, max_num_seqs=2
        ),
        prompts=st.sampled_from(["x", "y", 3]),
        fatal_prompts=st.just("device-fault"),
        params=sampling_params(steps=(1, 3)),
        executor_cls=docs_counting_executor(),
    )
    assert hunt(None, machine, max_examples=EXAMPLES) is None
    assert machine.reach.counts["path: death with other requests active"] > 0
