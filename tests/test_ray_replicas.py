"""Data-parallel replicas on a real two-node Ray cluster: routing, the engine API, a killed replica.

One cluster serves the whole module.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    InvalidFieldError,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from diffusion_runtime.replicas import ReplicaSet, ReplicaSetConfig  # noqa: E402

#: One xdist worker runs the whole module, so its module fixtures are built once.
pytestmark = pytest.mark.xdist_group("ray-replicas")

FAST = SamplingParams(num_inference_steps=2, seed=3, height=16, width=16)
ENGINE = EngineConfig(pipeline="testing-faults", device="cpu", warmup=False, intra_op_threads=1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and one worker node (2 logical CPUs each); always shut down."""
    cluster = Cluster()
    try:
        node = {"num_cpus": 2, "object_store_memory": 80 * 1024**2}
        cluster.add_node(include_dashboard=False, **node)
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def replica_set(cluster: Cluster) -> Iterator[Any]:
    """Build replica sets; at teardown close them and check their actors are gone."""
    built: list[ReplicaSet] = []

    def build(**overrides: Any) -> ReplicaSet:
        fields: dict[str, Any] = {"engine": ENGINE, "num_replicas": 2, "replica_cpus": 0.5}
        fields.update(overrides)
        replicas = ReplicaSet(ReplicaSetConfig(**fields))
        built.append(replicas)
        return replicas

    yield build
    for replicas in built:
        replicas.close()
        for actor in replicas.replicas:
            wait_until_dead(actor)
    assert not [t for t in threading.enumerate() if t.name == "diffusion-replica-heartbeat"]


def test_config_fields_are_checked() -> None:
    with pytest.raises(InvalidFieldError, match="routing"):
        ReplicaSetConfig(engine=ENGINE, routing="random")
    with pytest.raises(InvalidFieldError, match="engine"):
        ReplicaSetConfig(engine="digits")  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="num_replicas"):
        ReplicaSetConfig(engine=ENGINE, num_replicas=0)


def wait_until_dead(actor: Any) -> None:
    """Calls to ``actor`` fail because it ended (``ray.kill`` returns before that)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(actor.load.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.RayTaskError:  # still alive, its engine already closed
            pass
        assert time.monotonic() < deadline, "the replica actor never ended"
        time.sleep(0.01)


async def read_all(replicas: ReplicaSet, request_id: str) -> list[RequestOutput]:
    return [output async for output in replicas.stream(request_id)]


def test_requests_spread_by_load_and_keep_their_identity(replica_set: Any) -> None:
    replicas = replica_set(routing="least_loaded")
    prompts = ["cat", "dog", 7, "owl"]

    async def admit_then_read() -> list[RequestOutput]:
        ids = [await replicas.add_request(prompt, FAST) for prompt in prompts]
        assert replicas.snapshot().loads == (2, 2)
        return [(await read_all(replicas, rid))[-1] for rid in ids]

    streamed = asyncio.run(admit_then_read())
    generated = replicas.generate(prompts, FAST)
    with DiffusionEngine.make_engine(ENGINE) as alone:
        expected = alone.generate(prompts, FAST)
    for outputs in (streamed, generated):
        for got, want in zip(outputs, expected, strict=True):
            assert got.ok and got.image_batch is not None and want.image_batch is not None
            assert got.image_batch.equal(want.image_batch)
    snapshot = replicas.snapshot()
    assert not snapshot.routed_ids
    assert all(s is not None and not s.scheduler_ids for s in snapshot.replicas)


def test_bad_input_and_aborts_reach_the_caller(replica_set: Any) -> None:
    # Step mode: an abort takes effect between two steps of a long request.
    replicas = replica_set(num_replicas=1, engine=attrs.evolve(ENGINE, execution_mode="step"))
    with pytest.raises(InvalidFieldError, match="prompt must be a str or an int"):
        replicas.generate([2.5], FAST)
    with pytest.raises(InvalidFieldError, match="request_id"):
        asyncio.run(replicas.add_request("cat", FAST, request_id=""))

    async def abort_a_gated_request() -> RequestOutput:
        long = attrs.evolve(FAST, num_inference_steps=5000)
        rid = await replicas.add_request("cat", long)
        replicas.abort(rid)
        return (await read_all(replicas, rid))[-1]

    final = asyncio.run(abort_a_gated_request())
    assert final.status is RequestStatus.FINISHED_ABORTED


def test_a_killed_replica_fails_only_its_requests(replica_set: Any) -> None:
    replicas = replica_set(routing="least_loaded")

    async def scenario() -> tuple[RequestOutput, RequestOutput, float]:
        on_doomed = await replicas.add_request("gate", FAST)  # replica 0
        on_survivor = await replicas.add_request("cat", FAST)  # replica 1
        killed_at = time.monotonic()
        ray.kill(replicas.replicas[0], no_restart=True)
        failed = (await read_all(replicas, on_doomed))[-1]
        answered_after = time.monotonic() - killed_at
        # The kill takes effect a moment after ray.kill returns; once the doomed
        # request has failed, the front knows, and a new request goes to the survivor.
        rerouted = await replicas.add_request("owl", FAST)
        served = (await read_all(replicas, on_survivor))[-1]
        assert (await read_all(replicas, rerouted))[-1].ok
        return failed, served, answered_after

    failed, served, answered_after = asyncio.run(scenario())
    assert failed.status is RequestStatus.FINISHED_ERROR
    assert failed.error is not None and "replica 0" in failed.error
    assert failed.seed == FAST.seed
    assert answered_after < 2.0
    assert served.ok
    assert replicas.live_replicas == frozenset({1})
    replicas.check_health()
    assert all(output.ok for output in replicas.generate(["after", "the", "loss"], FAST))
    snapshot = replicas.snapshot()
    assert snapshot.replicas[0] is None and not snapshot.routed_ids
