"""Per-request TeaCache on the digits pipeline, through the real engine (``docs/caching.md``):
settings refused by field, bit-identity alone vs batched, step vs request mode,
preempted or not, a threshold of 0 equal to no cache, the counts in the metrics,
and the cached tensors gone with the request."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from executor_helpers import audited_core, drain

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.fsm.events import RunnerEvent
from diffusion_runtime.fsm.trace import read_trace
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.runner.worker import Worker
from diffusion_runtime.serving.metrics import EngineMetrics
from diffusion_runtime.stage import StageClient
from diffusion_runtime.testing.virtual_clock import VirtualClock

#: One xdist worker runs the whole module, so its module fixtures are built once.
pytestmark = pytest.mark.xdist_group("step-cache")

S = RequestStatus
#: Skips about a third of the steps of a 12-step request (measured).
CACHE = {"rel_l1_thresh": 0.3, "warmup_steps": 1}
MIX = [
    ("1", SamplingParams(num_inference_steps=12, seed=1)),
    ("2", SamplingParams(num_inference_steps=9, seed=2, guidance_scale=2.0)),
    ("3", SamplingParams(num_inference_steps=12, seed=3, num_outputs_per_prompt=2)),
    ("4", SamplingParams(num_inference_steps=7, seed=4, cache=False)),
    ("5", SamplingParams(num_inference_steps=12, seed=5, cache={"rel_l1_thresh": 0.6})),
    ("6", SamplingParams(num_inference_steps=10, seed=6, extra_args={"eta": 0.5})),
]


def engine_config(**overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "pipeline": "digits",
        "device": "cpu",
        "warmup": False,
        "audit": "raise",
        "max_num_seqs": 8,
        "cache_backend": "tea_cache",
        "cache_config": CACHE,
    }
    return EngineConfig(**{**fields, **overrides})


def open_core(
    clock: VirtualClock | None = None, **overrides: Any
) -> contextlib.AbstractContextManager[EngineCore]:
    """A step-mode core on :func:`engine_config` (on ``clock`` if given), audited."""
    config = engine_config(execution_mode="step", **overrides)
    return audited_core(config) if clock is None else audited_core(config, clock=clock)


def alone(
    mix: list[tuple[str, SamplingParams]] = MIX, mode: str = "step", **overrides: Any
) -> list[torch.Tensor]:
    """Each request of ``mix`` run by itself."""
    images = []
    with DiffusionEngine.make_engine(engine_config(execution_mode=mode, **overrides)) as engine:
        for prompt, params in mix:
            [out] = engine.generate([prompt], params)
            assert out.ok and out.image_batch is not None
            images.append(out.image_batch)
    return images


def together(
    mix: list[tuple[str, SamplingParams]], mode: str = "step", **overrides: Any
) -> list[RequestOutput]:
    """``mix`` submitted together to one engine (``max_num_seqs`` holds it all)."""
    with DiffusionEngine.make_engine(engine_config(execution_mode=mode, **overrides)) as engine:
        outs = engine.generate([p for p, _ in mix], [params for _, params in mix])
    assert all(out.ok and out.image_batch is not None for out in outs)
    return outs


@pytest.fixture(scope="module")
def solo() -> list[torch.Tensor]:
    return alone()


# -- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"cache_backend": "tae_cache"}, "cache_backend"),
        ({"cache_backend": 1}, "cache_backend"),
        ({"cache_config": {"threshold": 0.1}}, "cache_config['threshold']"),
        ({"cache_config": {"rel_l1_thresh": -0.1}}, "cache_config['rel_l1_thresh']"),
        ({"cache_config": {"rel_l1_thresh": float("nan")}}, "cache_config['rel_l1_thresh']"),
        ({"cache_config": {"warmup_steps": 1.5}}, "cache_config['warmup_steps']"),
        ({"cache_config": {"max_consecutive_skips": 0}}, "cache_config['max_consecutive_skips']"),
        ({"cache_config": {"backend": "tea_cache"}}, "cache_config['backend']"),
        ({"cache_config": [("rel_l1_thresh", 0.1)]}, "cache_config"),
    ],
)
def test_bad_engine_cache_settings_are_refused_by_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidFieldError) as info:
        EngineConfig(device="cpu", **fields)
    assert (info.value.owner, info.value.field) == ("EngineConfig", field)


@pytest.mark.parametrize(
    ("cache", "field"),
    [
        (True, "cache"),
        ("tea_cache", "cache"),
        ({"rel_l1": 0.1}, "cache['rel_l1']"),
        ({"rel_l1_thresh": True}, "cache['rel_l1_thresh']"),
        ({"warmup_steps": -1}, "cache['warmup_steps']"),
        ({"backend": "magcache"}, "cache['backend']"),
    ],
)
def test_bad_request_cache_settings_are_refused_by_field(cache: object, field: str) -> None:
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(cache=cache)  # type: ignore[arg-type]
    assert (info.value.owner, info.value.field) == ("SamplingParams", field)


def test_a_backend_the_pipeline_does_not_serve_is_refused() -> None:
    with pytest.raises(InvalidFieldError, match="serves tea_cache") as info:
        DiffusionEngine.make_engine(engine_config(cache_backend="first_block"))
    assert info.value.field == "cache_backend"
    with DiffusionEngine.make_engine(engine_config(cache_backend=None)) as engine:
        for cache, rule in [
            ({"backend": "first_block"}, "serves tea_cache"),
            ({"rel_l1_thresh": 0.2}, "names no backend"),
        ]:
            with pytest.raises(InvalidFieldError, match=rule) as info:
                engine.generate(["1"], SamplingParams(num_inference_steps=2, cache=cache))
            assert info.value.field == "cache"
        [out] = engine.generate(["1"], SamplingParams(num_inference_steps=4, cache=CACHE_ON))
        assert out.ok and out.metrics is not None


CACHE_ON = {"backend": "tea_cache", **CACHE}


# -- identity ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["step", "request"])
def test_batched_equals_alone_and_the_metrics_count_the_skips(
    solo: list[torch.Tensor], mode: str
) -> None:
    with DiffusionEngine.make_engine(engine_config(execution_mode=mode)) as engine:
        outs = engine.generate([p for p, _ in MIX], [params for _, params in MIX])
    for out, image, (_, params) in zip(outs, solo, MIX, strict=True):
        assert out.ok and out.image_batch is not None and out.metrics is not None
        assert torch.equal(out.image_batch, image), out.request_id
        metrics = out.metrics
        assert metrics.cached_steps + metrics.model_evaluations == params.num_inference_steps
    cached = [out.metrics.cached_steps for out in outs if out.metrics is not None]
    assert cached[3] == 0, "the request that opted out computes every step"
    assert cached[0] > 0 and cached[4] > cached[0], "a higher threshold skips more"


def test_requests_joining_at_different_steps_match_alone(solo: list[torch.Tensor]) -> None:
    with open_core() as core:
        for index, (prompt, params) in enumerate(MIX):
            core.add_request(f"r{index}", prompt, params, seed=params.seed)
            core.step()  # each joins a batch already under way
        finals = drain(core)
    for index, image in enumerate(solo):
        assert torch.equal(finals[f"r{index}"].image_batch, image), index


def test_a_zero_threshold_equals_no_cache() -> None:
    """Batched: the digits model computes each row alone, so a batch holds this as
    well as each request alone does (and costs one run, not six)."""
    engine_settings = [(prompt, attrs.evolve(params, cache=None)) for prompt, params in MIX]
    uncached = together(engine_settings, cache_backend=None)
    zero = together(engine_settings, cache_config={"rel_l1_thresh": 0.0})
    for a, b in zip(uncached, zero, strict=True):
        assert torch.equal(a.image_batch, b.image_batch), b.request_id
        assert b.metrics is not None and b.metrics.cached_steps == 0, b.request_id
    cached = together(engine_settings)
    assert not all(
        torch.equal(a.image_batch, b.image_batch) for a, b in zip(uncached, cached, strict=True)
    )


def test_a_preempted_and_offloaded_request_resumes_bit_identical(
    solo: list[torch.Tensor],
) -> None:
    prompt = MIX[0][0]
    low = SamplingParams(num_inference_steps=12, seed=1, priority=5)
    with open_core(
        max_num_seqs=1, scheduling_policy="priority", preempted_offload_bytes=2**30
    ) as core:
        core.add_request("low", prompt, low, seed=1)
        for _ in range(4):
            core.step()
        core.add_request("high", "9", SamplingParams(num_inference_steps=3), seed=9)
        core.step()
        assert core.scheduler.requests["low"].state is S.PREEMPTED
        assert core.snapshot().runner_offloaded_ids == {"low"}
        finals = drain(core)
    assert finals["low"].metrics is not None and finals["low"].metrics.cached_steps > 0
    assert torch.equal(finals["low"].image_batch, solo[0])


def test_the_mp_executor_gives_the_same_images(solo: list[torch.Tensor]) -> None:
    config = engine_config(execution_mode="step", executor_backend="mp")
    with DiffusionEngine.make_engine(config) as engine:
        outs = engine.generate([p for p, _ in MIX], [params for _, params in MIX])
    for out, image in zip(outs, solo, strict=True):
        assert torch.equal(out.image_batch, image), out.request_id


def test_the_stage_serves_cached_steps_and_their_counts_as_in_process(
    solo: list[torch.Tensor],
) -> None:
    """The cache settings cross the stage's socket with each request, and the counts
    come back in its metrics."""

    async def on_the_stage() -> list[Any]:
        async with StageClient(engine_config(execution_mode="step")) as client:
            return await client.generate([p for p, _ in MIX], [params for _, params in MIX])

    with DiffusionEngine.make_engine(engine_config(execution_mode="step")) as engine:
        expected = engine.generate([p for p, _ in MIX], [params for _, params in MIX])
    outs = asyncio.run(on_the_stage())
    for out, want, image in zip(outs, expected, solo, strict=True):
        assert out.ok and torch.equal(out.image_batch, image), out.request_id
        assert out.metrics is not None and want.metrics is not None
        counts = (out.metrics.cached_steps, out.metrics.model_evaluations)
        assert counts == (want.metrics.cached_steps, want.metrics.model_evaluations)
    assert sum(out.metrics.cached_steps for out in outs) > 0


# -- release -----------------------------------------------------------------------------


class CacheProbe:
    """A worker extension handing out weak references to a request's cached tensors."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def cached_tensor_refs(self, request_id: str) -> list[weakref.ref[torch.Tensor]]:
        cache = self.worker.runner.states[request_id].step_cache
        return [weakref.ref(t) for t in (cache.prediction, cache.signal) if t is not None]

    def inject_fault(self, request_id: str) -> None:
        """Break the request's conditioning, so that its next step raises."""
        runner = self.worker.runner
        runner.states[request_id].conditioning = "not a tensor"
        runner.input_batch.invalidate()


@pytest.mark.parametrize("end", ["finish", "abort", "fail", "deadline", "shutdown"])
def test_the_cached_tensors_go_with_the_request(end: str) -> None:
    clock = VirtualClock()
    with open_core(
        clock,
        worker_extensions=[CacheProbe],
        max_num_seqs=1,
        scheduling_policy="priority",
        deadline_miss="drop",
    ) as core:
        params = SamplingParams(num_inference_steps=12, seed=1, priority=5, deadline_s=1.0)
        core.add_request("r", "1", params, seed=1)
        for _ in range(3):
            core.step()
        refs = core.collective_rpc("cached_tensor_refs", ("r",), unique_reply_rank=0)
        assert len(refs) == 2 and all(ref() is not None for ref in refs)
        if end == "abort":
            core.abort(["r"])
        elif end == "fail":
            core.collective_rpc("inject_fault", ("r",))
        elif end == "deadline":  # preempted, then its deadline passes while it waits
            core.add_request("urgent", "9", SamplingParams(num_inference_steps=3), seed=9)
            core.step()
            assert core.scheduler.requests["r"].state is S.PREEMPTED
            clock.advance(2.0)
        finals = drain(core) if end != "shutdown" else {o.request_id: o for o in core.shutdown()}
        gc.collect()
        assert all(ref() is None for ref in refs), end
    expected = {
        "finish": S.FINISHED_COMPLETED,
        "abort": S.FINISHED_ABORTED,
        "fail": S.FINISHED_ERROR,
        "deadline": S.FINISHED_ABORTED,
        "shutdown": S.FINISHED_ABORTED,
    }
    assert finals["r"].status is expected[end]


# -- report ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["step", "request"])
def test_the_trace_and_prometheus_show_the_cached_steps(mode: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    config = engine_config(execution_mode=mode, trace_path=str(trace))
    with DiffusionEngine.make_engine(config) as engine:
        metrics = EngineMetrics(engine)
        metrics.attach()
        outs = engine.generate([p for p, _ in MIX], [params for _, params in MIX])
        counted = metrics.registry.get_sample_value("diffusion_cached_steps_total")
    reported = {out.request_id: out.metrics.cached_steps for out in outs if out.metrics}
    traced: dict[str, int] = {}
    for event in read_trace(trace):
        if isinstance(event, RunnerEvent):
            for rid, count in event.cached_steps:
                traced[rid] = traced.get(rid, 0) + count
    assert traced == {rid: count for rid, count in reported.items() if count}
    assert counted == sum(reported.values()) > 0
