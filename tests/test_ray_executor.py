"""The Ray executor on a real two-node Ray cluster (two raylets on this machine).

One cluster serves the whole module. Classes the worker actors build live at
module level; the cluster's processes find this file through ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
import torch
from conftest import engine_threads
from executor_helpers import (
    DEEPER_THAN_PICKLE,
    GatedPipeline,
    PreviewingNoise,
    chain,
    run_in_thread,
)
from hypothesis import HealthCheck, settings
from lora_adapters import FAULTY_NAME, FailStageOnRankOne, adapter, write_peft_adapter
from pause_rounds import ROUNDS, run_rounds

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    EngineDeadError,
    InvalidFieldError,
    LoRARequest,
    RPCError,
    SamplingParams,
)
from diffusion_runtime.testing.harness import lifecycle_test_case

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from diffusion_runtime.executor.ray import RayExecutor  # noqa: E402

#: One xdist worker runs the whole module, so its module fixtures are built once.
pytestmark = pytest.mark.xdist_group("ray-executor")

FAST = SamplingParams(num_inference_steps=2, seed=5, height=16, width=16)
NODE_CPUS = 2
OBJECT_STORE_BYTES = 80 * 1024**2
# Seconds within which every caller must hear of a lost worker.
ANSWER_BOUND_S = 2.0


class Probe:
    """A worker extension: each public method is an RPC method on every rank."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def rank(self) -> int:
        return int(self.worker.rank)

    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "awake"


# -- the cluster ---------------------------------------------------------------------


def start_node(cluster: Cluster, head: bool = False) -> Any:
    args: dict[str, Any] = {"num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES}
    if head:
        args["include_dashboard"] = False
    return cluster.add_node(**args)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and one worker node; this process is the driver. Always shut down."""
    tests_dir = str(Path(__file__).parent)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, saved) if p)
    cluster = Cluster()
    try:
        start_node(cluster, head=True)
        start_node(cluster)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture
def two_nodes(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with two live nodes, before and after the test (which may remove one)."""
    while len(cluster.list_all_nodes()) < 2:
        start_node(cluster)
    cluster.wait_for_nodes()
    yield cluster
    while len(cluster.list_all_nodes()) < 2:
        start_node(cluster)
    cluster.wait_for_nodes()


def ray_config(**overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "pipeline": "testing-faults",
        "device": "cpu",
        "executor_backend": "ray",
        "num_workers": 2,
        "ray_cpus_per_worker": 0.5,
        "ray_placement_strategy": "STRICT_SPREAD",
        "worker_extensions": (Probe,),
        "shutdown_grace_s": 1.0,
        "warmup": False,
    }
    fields.update(overrides)
    return EngineConfig(**fields)


@pytest.fixture
def ray_engine(two_nodes: Cluster) -> Iterator[Callable[..., DiffusionEngine]]:
    """Build Ray engines; at teardown close them and check nothing of theirs is left."""
    engines: list[DiffusionEngine] = []

    def build(**overrides: Any) -> DiffusionEngine:
        engine = DiffusionEngine.make_engine(ray_config(**overrides))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()
    for engine in engines:
        assert_released(executor_of(engine))
    assert engine_threads() == []
    assert not [t for t in threading.enumerate() if t.name == "diffusion-ray-liveness"]


def executor_of(engine: DiffusionEngine) -> RayExecutor:
    executor = engine.core.executor
    assert isinstance(executor, RayExecutor)
    return executor


def assert_released(executor: RayExecutor) -> None:
    """Every actor of the executor is dead and its placement group removed."""
    for actor in executor.actors:
        wait_until(lambda actor=actor: is_dead(actor), "the actor to end")
    states = {entry["state"] for entry in placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def is_dead(actor: Any) -> bool:
    """Whether calls to ``actor`` fail because it ended (``ray.kill`` returns before that)."""
    try:
        ray.get(actor.ping.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- generating across nodes -------------------------------------------------------------


def test_workers_on_two_nodes_generate_as_one_process_does(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = ray_engine()
    executor = executor_of(engine)
    assert len(set(executor.worker_node_ids)) == 2
    prompts = ["cat", "dog", 7, "owl"]
    outputs = engine.generate(prompts, FAST)
    assert all(output.ok for output in outputs)
    with DiffusionEngine.make_engine(
        EngineConfig(pipeline="testing-faults", device="cpu", warmup=False)
    ) as alone:
        expected = alone.generate(prompts, FAST)
    for got, want in zip(outputs, expected, strict=True):
        assert got.image_batch is not None and want.image_batch is not None
        assert got.image_batch.equal(want.image_batch)
    snapshot = engine.snapshot()
    assert not snapshot.scheduler_ids and not snapshot.runner_cached_ids


def test_adapters_are_loaded_on_every_rank_or_on_none(
    ray_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    engine = ray_engine(pipeline="digits", max_loras=2, worker_extensions=(FailStageOnRankOne,))
    lora = adapter(tmp_path, 1)
    assert engine.add_lora(lora) is True
    assert engine.collective_rpc("list_loras") == [[1], [1]]
    with pytest.raises(OSError, match="disk error on rank 1"):
        engine.add_lora(LoRARequest(FAULTY_NAME, 2, lora.path))
    assert engine.collective_rpc("staged_lora_ids") == [[], []]
    assert engine.list_loras() == [1] and engine.pin_lora(1)
    params = SamplingParams(num_inference_steps=2, seed=0, lora=lora)
    assert engine.generate(["4"], params)[0].ok
    assert engine.remove_lora(1) and engine.collective_rpc("list_loras") == [[], []]


@pytest.mark.parametrize("mode", ["request", "step"])
def test_what_was_queued_while_paused_is_scheduled_together_and_aborts_apply_first(
    ray_engine: Callable[..., DiffusionEngine], mode: str
) -> None:
    """300 rounds of pause, admit three, admit and abort a fourth, resume."""
    engine = ray_engine(execution_mode=mode, max_num_seqs=4)
    run_rounds(engine, (FAST,) * 3, ROUNDS)


def test_streamed_previews_and_large_images_cross_the_object_store(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    """Step mode with previews; a 192x192 image (432 KiB) is stored out of band by Ray."""
    engine = ray_engine(
        pipeline=PreviewingNoise, streaming_output=True, preview_interval=1, num_workers=1
    )
    large = SamplingParams(num_inference_steps=3, seed=9, height=192, width=192)

    async def read() -> list[Any]:
        rid = await engine.add_request("cat", large)
        return [output async for output in engine.stream(rid)]

    outputs = asyncio.run(read())
    assert len(outputs) >= 2
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert all(o.image_batch is not None for o in outputs[:-1])  # the previews
    with DiffusionEngine.make_engine(
        EngineConfig(pipeline=PreviewingNoise, device="cpu", warmup=False)
    ) as alone:
        [expected] = alone.generate(["cat"], large)
    final = outputs[-1]
    assert final.ok and final.image_batch is not None and expected.image_batch is not None
    assert final.image_batch.shape == (1, 3, 192, 192)
    assert final.image_batch.equal(expected.image_batch)


def test_rpc_replies_by_rank_time_out_and_refuse_bad_input(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = ray_engine()
    assert engine.collective_rpc("rank") == [0, 1]
    assert engine.collective_rpc("rank", unique_reply_rank=1) == 1
    with pytest.raises(RPCError, match="does not exist"):
        engine.collective_rpc("rank", unique_reply_rank=2)
    with pytest.raises(RPCError, match="not callable"):
        engine.collective_rpc("no_such_method")
    started = time.monotonic()
    with pytest.raises(RPCError, match="timed out"):
        engine.collective_rpc("nap", (3.0,), timeout=0.3)
    assert time.monotonic() - started < 2.0
    with pytest.raises(InvalidFieldError, match="prompt must be a str or an int"):
        engine.generate([2.5], FAST)
    with pytest.raises(InvalidFieldError, match="picklable"):
        engine.generate([threading.Lock()], FAST)
    # The timed-out nap ran to its end on the workers; the engine still serves.
    [output] = engine.generate(["after"], FAST)
    assert output.ok


def test_a_request_that_cannot_reach_the_actors_is_refused_by_its_field(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = ray_engine(num_workers=1)
    with pytest.raises(InvalidFieldError, match="must be picklable") as unpicklable:
        engine.generate(["x"], attrs.evolve(FAST, extra_args={"lock": threading.Lock()}))
    assert (unpicklable.value.owner, unpicklable.value.field) == ("SamplingParams", "extra_args")
    with pytest.raises(InvalidFieldError, match="nested too deeply") as deep:
        engine.generate([chain(DEEPER_THAN_PICKLE)], FAST)
    assert deep.value.field == "prompt"
    with pytest.raises(InvalidFieldError, match="nested too deeply") as deep_args:
        engine.generate(["x"], attrs.evolve(FAST, extra_args={"deep": chain(DEEPER_THAN_PICKLE)}))
    assert deep_args.value.field == "extra_args"
    assert engine.generate(["fine"], FAST)[0].ok


def test_config_fields_are_checked() -> None:
    with pytest.raises(InvalidFieldError, match="ray_placement_strategy"):
        ray_config(ray_placement_strategy="ANYWHERE")
    with pytest.raises(InvalidFieldError, match="ray_cpus_per_worker"):
        ray_config(ray_cpus_per_worker=-1)
    with pytest.raises(InvalidFieldError, match="ray_liveness_timeout_s"):
        ray_config(ray_liveness_timeout_s=0)
    with pytest.raises(InvalidFieldError, match="ray_address"):
        ray_config(ray_address="")


def test_cfg_parallel_actors_share_one_model_bit_identical_to_one_rank(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    """Two actors on two nodes join one gloo group through the executor's store and
    split the guidance branches; every image equals one rank's, bit for bit."""
    params = [
        SamplingParams(num_inference_steps=4, guidance_scale=3.0, seed=1),
        SamplingParams(num_inference_steps=3, num_outputs_per_prompt=2, seed=2),
        SamplingParams(num_inference_steps=4, guidance_scale=1.5, num_outputs_per_prompt=2, seed=3),
    ]
    prompts = ["3", "5", "8"]
    with DiffusionEngine.make_engine(EngineConfig(pipeline="digits", device="cpu")) as one:
        expected = one.generate(prompts, params)
    engine = ray_engine(pipeline="digits", cfg_parallel_size=2, worker_extensions=())
    for got, want in zip(engine.generate(prompts, params), expected, strict=True):
        assert got.ok and torch.equal(got.image_batch, want.image_batch)


def test_ulysses_actors_split_the_dit_tokens_within_rounding_of_one_rank(
    ray_engine: Callable[..., DiffusionEngine], models: Any, tmp_path: Path
) -> None:
    """Two actors on two nodes split every row's tokens of a DiT (all-to-all over
    heads through their gloo group); every image is within rounding of one rank's."""
    models.dit_pipeline().save_pretrained(tmp_path)
    dit = {"pipeline": "diffusers", "pipeline_kwargs": {"path": str(tmp_path)}}
    params = [
        SamplingParams(num_inference_steps=3, guidance_scale=3.0, seed=1),
        SamplingParams(num_inference_steps=2, num_outputs_per_prompt=2, seed=2),
    ]
    prompts = [3, 5]
    with DiffusionEngine.make_engine(EngineConfig(**dit, device="cpu", warmup=False)) as one:
        expected = one.generate(prompts, params)
    engine = ray_engine(**dit, ulysses_degree=2, worker_extensions=())
    for got, want in zip(engine.generate(prompts, params), expected, strict=True):
        assert got.ok and (got.image_batch - want.image_batch).abs().max().item() <= 1e-4


def test_step_caches_on_actors_skip_and_count_as_in_process(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    """Per-request TeaCache on two actors (docs/caching.md): the images, and the cached
    steps and model evaluations each request reports, equal one process's."""
    tea = {"backend": "tea_cache", "rel_l1_thresh": 0.3}
    params = [
        SamplingParams(num_inference_steps=10, guidance_scale=2.0, seed=1, cache=tea),
        SamplingParams(num_inference_steps=8, num_outputs_per_prompt=2, seed=2, cache=tea),
        SamplingParams(num_inference_steps=6, seed=3),
    ]
    prompts = ["3", "5", "8"]
    config = {"pipeline": "digits", "execution_mode": "step", "max_num_seqs": 4}
    with DiffusionEngine.make_engine(EngineConfig(device="cpu", **config)) as one:
        expected = one.generate(prompts, params)
    engine = ray_engine(worker_extensions=(), **config)
    got = engine.generate(prompts, params)
    for have, want in zip(got, expected, strict=True):
        assert have.ok and torch.equal(have.image_batch, want.image_batch)
        assert have.metrics is not None and want.metrics is not None
        counts = (have.metrics.cached_steps, have.metrics.model_evaluations)
        assert counts == (want.metrics.cached_steps, want.metrics.model_evaluations)
    assert got[0].metrics is not None and got[0].metrics.cached_steps > 0
    assert got[2].metrics is not None and got[2].metrics.cached_steps == 0


def test_a_worker_that_cannot_start_releases_everything(two_nodes: Cluster) -> None:
    with pytest.raises(Exception, match="no_such_module"):
        RayExecutor(ray_config(pipeline="no_such_module:no-such-pipeline"))
    with pytest.raises(Exception, match="could not reserve"):
        RayExecutor(ray_config(num_workers=3, worker_start_timeout_s=0.5))
    wait_until(lambda: set(placement_group_table_states()) <= {"REMOVED"}, "removal")


def placement_group_table_states() -> list[str]:
    return [entry["state"] for entry in placement_group_table().values()]


# -- losing a worker mid-wave ------------------------------------------------------------


def gated_engine(ray_engine: Callable[..., DiffusionEngine], flag_dir: Path) -> DiffusionEngine:
    return ray_engine(pipeline=GatedPipeline, pipeline_kwargs={"flag_dir": str(flag_dir)})


def callers_during_a_held_wave(engine: DiffusionEngine, flag_dir: Path) -> list[CallerOutcome]:
    """Start a blocked wave (a :class:`GatedPipeline` engine's) and callers of every
    kind; return their outcome holders."""
    holders = [CallerOutcome() for _ in range(3)]

    def run_generate(prompt: str, holder: CallerOutcome) -> None:
        try:
            engine.generate([prompt], FAST)
        except BaseException as exc:
            holder.finish(exc)
        else:
            holder.finish(None)

    async def add_and_stream(holder: CallerOutcome) -> None:
        try:
            rid = await engine.add_request("queued", FAST)
            async for _ in engine.stream(rid):
                pass
        except BaseException as exc:
            holder.finish(exc)
        else:
            holder.finish(None)

    threading.Thread(target=run_generate, args=("gate", holders[0]), daemon=True).start()
    wait_until(lambda: any(flag_dir.glob("entered-*")), "the gated wave")
    threading.Thread(target=run_generate, args=("waiting", holders[1]), daemon=True).start()
    threading.Thread(target=lambda: asyncio.run(add_and_stream(holders[2])), daemon=True).start()
    wait_until(lambda: engine.queue_length >= 2, "the queued callers")
    return holders


class CallerOutcome:
    """What one caller ended with, and when."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at = 0.0

    def finish(self, error: BaseException | None) -> None:
        self.error, self.at = error, time.monotonic()
        self.done.set()


def assert_every_caller_failed_fast(holders: list[CallerOutcome], since: float) -> None:
    for holder in holders:
        assert holder.done.wait(ANSWER_BOUND_S + 5), "a caller was never answered"
        assert isinstance(holder.error, EngineDeadError), holder.error
        assert holder.at - since < ANSWER_BOUND_S, holder.at - since


def test_a_killed_actor_fails_every_caller_and_the_engine(
    ray_engine: Callable[..., DiffusionEngine], tmp_path: Path
) -> None:
    engine = gated_engine(ray_engine, tmp_path)
    holders = callers_during_a_held_wave(engine, tmp_path)
    pid = executor_of(engine).worker_pids[1]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert_every_caller_failed_fast(holders, killed_at)
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_a_removed_node_fails_every_caller_and_the_engine(
    ray_engine: Callable[..., DiffusionEngine], two_nodes: Cluster, tmp_path: Path
) -> None:
    engine = gated_engine(ray_engine, tmp_path)
    holders = callers_during_a_held_wave(engine, tmp_path)
    head_id = two_nodes.head_node.node_id
    [doomed] = [
        node
        for node in two_nodes.list_all_nodes()
        if node.node_id in executor_of(engine).worker_node_ids and node.node_id != head_id
    ]
    removed_at = time.monotonic()
    two_nodes.remove_node(doomed)
    assert_every_caller_failed_fast(holders, removed_at)
    with pytest.raises(EngineDeadError):
        engine.check_health()


class PassCount:
    """A worker extension: how many network passes this rank has run."""

    def __init__(self, worker: Any) -> None:
        self.passes = 0
        worker.pipeline.model.register_forward_pre_hook(self._count)

    def _count(self, module: Any, args: Any) -> None:
        self.passes += 1

    def network_passes(self) -> int:
        return self.passes


def test_an_actor_killed_mid_gather_fails_every_caller_and_the_engine(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = ray_engine(
        pipeline="digits",
        cfg_parallel_size=2,
        execution_mode="step",
        worker_extensions=(PassCount,),
    )
    long_guided = SamplingParams(num_inference_steps=1000, guidance_scale=3.0)
    callers = [
        run_in_thread(lambda p=params: engine.generate(["3"], p))
        for params in (attrs.evolve(long_guided, seed=s) for s in (1, 2))
    ]
    # RPCs run between steps: rank 1 is in the middle of the guided run.
    wait_until(lambda: engine.collective_rpc("network_passes")[1] > 5, "a few guided steps")
    killed_at = time.monotonic()
    os.kill(executor_of(engine).worker_pids[1], signal.SIGKILL)
    for caller in callers:
        with pytest.raises(EngineDeadError):
            caller.result(ANSWER_BOUND_S + 5)
    assert time.monotonic() - killed_at < ANSWER_BOUND_S


# -- the lifecycle harness ---------------------------------------------------------------


def kill_rank_one(engine: DiffusionEngine) -> None:
    os.kill(engine.collective_rpc("pid")[1], signal.SIGKILL)


def harness(max_examples: int) -> type[unittest.TestCase]:
    """The lifecycle harness (auditor, cleanup, solo-run equality) with a killed actor."""
    return lifecycle_test_case(
        lambda: ray_config(max_num_seqs=3),
        target="front",
        prompts=st.sampled_from(["cat", "dog", 7]),
        failing_prompts=st.sampled_from(["fail", "missing"]),
        worker_killer=kill_rank_one,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


@pytest.mark.usefixtures("two_nodes")
class TestLifecycleOverRayActors(harness(max_examples=2)):  # type: ignore[misc]
    pass


@pytest.mark.slow
@pytest.mark.usefixtures("two_nodes")
class TestLifecycleOverRayActorsAtLength(harness(max_examples=20)):  # type: ignore[misc]
    pass


def test_ray_workers_sleep_at_level_2_and_wake_bit_identical(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    """Sleep reaches Ray actors through the executor's generic collective calls."""
    engine = ray_engine(pipeline="digits", execution_mode="step")
    prompts = ["3", "8"]
    before = engine.generate(prompts, FAST)
    held = engine.collective_rpc("device_weight_bytes")
    engine.sleep(2)
    assert engine.is_sleeping and engine.collective_rpc("device_weight_bytes") == [0, 0]
    engine.wake_up()
    assert engine.collective_rpc("device_weight_bytes") == held
    after = engine.generate(prompts, FAST)
    for got, want in zip(after, before, strict=True):
        assert got.image_batch is not None and want.image_batch is not None
        assert got.image_batch.equal(want.image_batch)


def test_trajectories_and_latents_cross_the_object_store_bit_for_bit(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    """Latents, trajectories and log-probabilities come back from Ray actors as the
    same bits as in process (the testing pipeline's stochastic steps, and a custom
    schedule), with the workers' stage durations and peak memory."""
    params = [
        SamplingParams(
            num_inference_steps=4, seed=3, extra_args={"noise": 0.5}, return_trajectory="full"
        ),
        SamplingParams(num_inference_steps=3, seed=4, output_type="latent"),
        SamplingParams(seed=5, timesteps=(9, 5, 2), return_trajectory="latents"),
    ]
    engine = ray_engine(execution_mode="step")
    over_ray = engine.generate(["cat", "dog", "cow"], params)
    with DiffusionEngine.make_engine(
        ray_config(executor_backend="uni", num_workers=1, execution_mode="step")
    ) as local:
        in_process = local.generate(["cat", "dog", "cow"], params)
    full, latent, scheduled = over_ray
    assert scheduled.trajectory is not None and scheduled.trajectory.timesteps == (9, 5, 2)
    for output in over_ray:  # the workers' costs cross too
        assert output.metrics is not None and output.metrics.stage_durations["denoise"] > 0
        assert output.metrics.peak_memory_mb is not None
    assert full.trajectory is not None and full.trajectory.log_probs is not None
    assert latent.latents is not None and latent.image_batch is None
    for remote, here in zip(over_ray, in_process, strict=True):
        for name in ("image_batch", "latents"):
            mine, theirs = getattr(remote, name), getattr(here, name)
            assert (mine is None) == (theirs is None)
            assert mine is None or torch.equal(mine, theirs)
    assert in_process[0].trajectory is not None and in_process[2].trajectory is not None
    assert torch.equal(full.trajectory.latents, in_process[0].trajectory.latents)
    assert torch.equal(scheduled.trajectory.latents, in_process[2].trajectory.latents)
    assert full.trajectory.log_probs is not None
    assert torch.equal(full.trajectory.log_probs, in_process[0].trajectory.log_probs)


def test_diffusers_adapters_load_on_every_actor_and_serve_as_in_process(
    ray_engine: Callable[..., DiffusionEngine], models: Any, tmp_path: Path
) -> None:
    """A diffusers pipeline's adapters load through peft on both actors (two nodes);
    the images are the in-process engine's, bit for bit (one intra-op thread each)."""
    pytest.importorskip("peft")
    (tmp_path / "tokenizer").mkdir()
    pipe = models.stable_diffusion_pipeline(tmp_path / "tokenizer")
    pipe.save_pretrained(tmp_path / "sd")
    path = write_peft_adapter(pipe, tmp_path / "adapter", ["to_q", "to_v"], rank=2, alpha=4, seed=1)
    lora = LoRARequest("style", 1, str(path))
    fields: dict[str, Any] = {
        "pipeline": "diffusers",
        "pipeline_kwargs": {"path": str(tmp_path / "sd")},
        "max_loras": 1,
        "execution_mode": "step",
        "intra_op_threads": 1,
    }
    engine = ray_engine(worker_extensions=(), **fields)
    assert engine.add_lora(lora) is True
    assert engine.collective_rpc("list_loras") == [[1], [1]]
    requests = [
        SamplingParams(num_inference_steps=2, seed=5, guidance_scale=3.0, lora=lora),
        SamplingParams(num_inference_steps=2, seed=5, guidance_scale=3.0),
    ]
    over_ray = engine.generate(["ab", "ab"], requests)
    with DiffusionEngine.make_engine(
        ray_config(executor_backend="uni", num_workers=1, **fields)
    ) as local:
        in_process = local.generate(["ab", "ab"], requests)
    for remote, here in zip(over_ray, in_process, strict=True):
        assert remote.ok, remote.error
        assert torch.equal(remote.image_batch, here.image_batch)
    assert not torch.equal(over_ray[0].image_batch, over_ray[1].image_batch)


def test_a_streamed_trajectory_crosses_the_object_store_part_by_part(
    ray_engine: Callable[..., DiffusionEngine],
) -> None:
    """``stream_trajectory`` on Ray actors: each progress output's part, and the final
    trajectory, as in process (one intra-op thread on both sides)."""
    from test_streamed_trajectories import STREAMED, check_stream
    from test_streamed_trajectories import config as digits_config

    engine = ray_engine(
        pipeline="digits",
        execution_mode="step",
        streaming_output=True,
        intra_op_threads=1,
        worker_extensions=(),
    )

    async def read() -> list[Any]:
        rid = await engine.add_request("3", STREAMED)
        return [output async for output in engine.stream(rid)]

    outputs = asyncio.run(read())
    quiet = attrs.evolve(STREAMED, stream_trajectory=False)
    with DiffusionEngine.make_engine(digits_config(intra_op_threads=1)) as alone:
        [expected] = alone.generate(["3"], quiet)
    check_stream(outputs, expected)
