"""Per-request TeaCache and first-block cache on the tiny diffusers DiT, through the real
engine (``docs/caching.md``): alone equals batched with fixed-size denoiser calls, in
step and request mode; a threshold of 0 equals no cache; the cached tensors go with
the request; a pipeline without the backend refuses it by field."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from conftest import factory_of
from executor_helpers import audited_core, drain

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.runner.worker import Worker

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
    # one xdist worker runs the whole module, so its module fixtures are built once
    pytest.mark.xdist_group("dit-step-cache"),
]
S = RequestStatus
#: Skips a third to a half of a 12-step request's steps with either backend (measured).
CACHE = {"rel_l1_thresh": 0.3, "warmup_steps": 1}
MIX = [
    (1, SamplingParams(num_inference_steps=12, seed=1)),
    (2, SamplingParams(num_inference_steps=9, seed=2, guidance_scale=2.0)),
    ("goldfish", SamplingParams(num_inference_steps=12, seed=3, num_outputs_per_prompt=2)),
    (4, SamplingParams(num_inference_steps=7, seed=4, cache=False)),
    (5, SamplingParams(num_inference_steps=12, seed=5, cache={"rel_l1_thresh": 0.6})),
    (6, SamplingParams(num_inference_steps=10, seed=6, cache={"backend": "tea_cache"})),
    (7, SamplingParams(num_inference_steps=10, seed=7, cache={"backend": "first_block"})),
]
BACKENDS = ["tea_cache", "first_block"]
#: The zero-threshold tests' requests: the engine's cache settings decide for them.
UNCACHED_MIX = [(prompt, attrs.evolve(params, cache=None)) for prompt, params in MIX[:3]]


@pytest.fixture(scope="module")
def dit(models: Any) -> Any:
    return models.dit_pipeline()


@pytest.fixture(scope="module")
def solo(dit: Any) -> Callable[[str], list[torch.Tensor]]:
    """Each request of ``MIX`` run by itself in step mode, per backend: computed once a
    module for the tests that compare against it (read, never changed)."""
    images: dict[str, list[torch.Tensor]] = {}

    def of(backend: str) -> list[torch.Tensor]:
        if backend not in images:
            images[backend] = alone(dit, backend, MIX, "step")
        return images[backend]

    return of


@pytest.fixture(scope="module")
def uncached(dit: Any) -> Callable[[str], list[RequestOutput]]:
    """The first three requests of ``MIX`` batched without a cache, per mode: computed
    once a module for the zero-threshold tests of both backends."""
    outputs: dict[str, list[RequestOutput]] = {}

    def of(mode: str) -> list[RequestOutput]:
        if mode not in outputs:
            outputs[mode] = run(dit, None, UNCACHED_MIX, mode)
        return outputs[mode]

    return of


def engine_config(dit: Any, backend: str | None, **overrides: Any) -> EngineConfig:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    fields: dict[str, Any] = {
        "pipeline": factory_of(DiffusersPipeline(dit, rows_per_call=8)),
        "device": "cpu",
        "warmup": False,
        "audit": "raise",
        "max_num_seqs": 8,
        "cache_backend": backend,
        "cache_config": CACHE if backend is not None else {},
    }
    return EngineConfig(**{**fields, **overrides})


def open_core(
    dit: Any, backend: str, **overrides: Any
) -> contextlib.AbstractContextManager[EngineCore]:
    """A step-mode core on :func:`engine_config`, audited."""
    return audited_core(engine_config(dit, backend, execution_mode="step", **overrides))


def run(
    dit: Any, backend: str | None, mix: list[tuple[Any, SamplingParams]], mode: str, **kw: Any
) -> list[RequestOutput]:
    """``mix`` submitted together to one engine."""
    config = engine_config(dit, backend, execution_mode=mode, **kw)
    with DiffusionEngine.make_engine(config) as engine:
        return engine.generate([p for p, _ in mix], [params for _, params in mix])


def alone(
    dit: Any, backend: str | None, mix: list[tuple[Any, SamplingParams]], mode: str, **kw: Any
) -> list[torch.Tensor]:
    """Each request of ``mix`` run by itself."""
    images = []
    with DiffusionEngine.make_engine(engine_config(dit, backend, execution_mode=mode, **kw)) as e:
        for prompt, params in mix:
            [out] = e.generate([prompt], params)
            assert out.image_batch is not None
            images.append(out.image_batch)
    return images


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_equals_alone_in_both_modes_and_the_metrics_count_the_skips(
    dit: Any, solo: Callable[[str], list[torch.Tensor]], backend: str
) -> None:
    for mode in ("step", "request"):
        outs = run(dit, backend, MIX, mode)
        for out, image in zip(outs, solo(backend), strict=True):
            assert torch.equal(out.image_batch, image), (mode, out.request_id)
        steps = [params.num_inference_steps for _, params in MIX]
        metrics = [out.metrics for out in outs]
        assert all(m is not None for m in metrics)
        cached = [m.cached_steps for m in metrics if m is not None]
        evaluations = [m.model_evaluations for m in metrics if m is not None]
        assert [c + e for c, e in zip(cached, evaluations, strict=True)] == steps
        assert cached[3] == 0 and all(c > 0 for i, c in enumerate(cached) if i != 3), cached


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_joining_at_different_steps_match_alone(
    dit: Any, solo: Callable[[str], list[torch.Tensor]], backend: str
) -> None:
    with open_core(dit, backend) as core:
        for index, (prompt, params) in enumerate(MIX):
            core.add_request(f"r{index}", prompt, params, seed=params.seed)
            core.step()  # each joins a batch already under way
        finals = drain(core)
    for index, image in enumerate(solo(backend)):
        assert torch.equal(finals[f"r{index}"].image_batch, image), index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["step", "request"])
def test_a_zero_threshold_equals_no_cache(
    dit: Any, uncached: Callable[[str], list[RequestOutput]], backend: str, mode: str
) -> None:
    zero = run(dit, backend, UNCACHED_MIX, mode, cache_config={"rel_l1_thresh": 0.0})
    for a, b in zip(uncached(mode), zero, strict=True):
        assert torch.equal(a.image_batch, b.image_batch)
        assert b.metrics is not None and b.metrics.cached_steps == 0
    cached = run(dit, backend, UNCACHED_MIX, mode)
    assert not any(
        torch.equal(a.image_batch, b.image_batch)
        for a, b in zip(uncached(mode), cached, strict=True)
    )


def test_a_preempted_and_offloaded_request_resumes_bit_identical(dit: Any) -> None:
    params = SamplingParams(num_inference_steps=12, seed=1, priority=5, guidance_scale=2.0)
    [solo] = alone(dit, "first_block", [(1, params)], "step")
    with open_core(
        dit,
        "first_block",
        max_num_seqs=1,
        scheduling_policy="priority",
        preempted_offload_bytes=2**30,
    ) as core:
        core.add_request("low", 1, params, seed=1)
        for _ in range(4):
            core.step()
        core.add_request("high", 9, SamplingParams(num_inference_steps=3), seed=9)
        core.step()
        assert core.scheduler.requests["low"].state is S.PREEMPTED
        assert core.snapshot().runner_offloaded_ids == {"low"}
        finals = drain(core)
    assert finals["low"].metrics is not None and finals["low"].metrics.cached_steps > 0
    assert torch.equal(finals["low"].image_batch, solo)


def test_a_pipeline_without_the_backend_refuses_it_by_field(models: Any) -> None:
    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    config = EngineConfig(
        pipeline=factory_of(DiffusersPipeline(models.ddim_pipeline())),
        device="cpu",
        warmup=False,
        cache_backend="first_block",
    )
    with pytest.raises(InvalidFieldError, match="DiffusersPipeline serves none"):
        DiffusionEngine.make_engine(config)


class CacheProbe:
    """A worker extension handing out weak references to a request's cached tensors."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def cached_tensor_refs(self, request_id: str) -> list[weakref.ref[torch.Tensor]]:
        cache = self.worker.runner.states[request_id].step_cache
        names = ("prediction", "signal", "first_residual", "later_residual")
        tensors = [getattr(cache, name, None) for name in names]
        return [weakref.ref(t) for t in tensors if t is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("end", ["finish", "abort", "shutdown"])
def test_the_cached_tensors_go_with_the_request(dit: Any, backend: str, end: str) -> None:
    with open_core(dit, backend, worker_extensions=[CacheProbe]) as core:
        core.add_request("r", 1, SamplingParams(num_inference_steps=8, seed=1), seed=1)
        for _ in range(3):
            core.step()
        refs = core.collective_rpc("cached_tensor_refs", ("r",), unique_reply_rank=0)
        assert len(refs) == 2 and all(ref() is not None for ref in refs)
        if end == "abort":
            core.abort(["r"])
        finals = drain(core) if end != "shutdown" else {o.request_id: o for o in core.shutdown()}
        gc.collect()
        assert all(ref() is None for ref in refs), end
    expected = S.FINISHED_COMPLETED if end == "finish" else S.FINISHED_ABORTED
    assert finals["r"].status is expected
