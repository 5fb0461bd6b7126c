"""The worker actors of one executor and the placement group that reserves their resources."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.executor.mp.group import WorkerStartError
from diffusion_runtime.executor.ray.actor import SIDE_GROUP, RayWorker, WorkerDescription
from diffusion_runtime.executor.ray.failures import remote_cause
from diffusion_runtime.executor.ray.rendezvous import StoreAddress

logger = logging.getLogger(__name__)


def worker_bundle(config: EngineConfig) -> dict[str, float]:
    """The resources one worker rank reserves: its CPUs, and one GPU on CUDA."""
    bundle = {"CPU": config.ray_cpus_per_worker}
    if config.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


class RayWorkerGroup:
    """Reserves one bundle per rank, starts one :class:`RayWorker` actor in each, and
    waits (up to ``worker_start_timeout_s``) until every rank has built its worker.

    With ``store``, the actors join one ``torch.distributed`` group through it
    before building their workers. If anything fails on the way, every actor
    and the reservation are released before the error reaches the caller.
    """

    def __init__(self, config: EngineConfig, store: StoreAddress | None = None) -> None:
        self.placement_group: PlacementGroup | None = None
        self.actors: list[Any] = []
        deadline = time.monotonic() + config.worker_start_timeout_s
        bundle = worker_bundle(config)
        try:
            self.placement_group = placement_group(
                [bundle] * config.num_workers, strategy=config.ray_placement_strategy
            )
            if not self._wait_placed(self.placement_group, deadline):
                raise WorkerStartError(
                    0,
                    f"the cluster could not reserve {config.num_workers} x {bundle} "
                    f"({config.ray_placement_strategy}) within "
                    f"{config.worker_start_timeout_s} s",
                )
            actor_class = ray.remote(  # type: ignore[call-overload]
                concurrency_groups={SIDE_GROUP: 1}
            )(RayWorker)
            self.actors = [
                actor_class.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=rank
                    ),
                ).remote(config, rank, store)
                for rank in range(config.num_workers)
            ]
            self.descriptions = self._wait_started(deadline)
        except BaseException:
            self.stop(grace=0.0)
            raise

    @staticmethod
    def _wait_placed(group: PlacementGroup, deadline: float) -> bool:
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
        return bool(ready)

    def _wait_started(self, deadline: float) -> list[WorkerDescription]:
        descriptions: list[WorkerDescription] = []
        for rank, actor in enumerate(self.actors):
            try:
                description = ray.get(
                    actor.describe.remote(), timeout=max(0.0, deadline - time.monotonic())
                )
            except ray.exceptions.GetTimeoutError:
                raise WorkerStartError(rank, "did not start in time") from None
            except ray.exceptions.RayError as exc:
                # An actor whose construction raised dies; Ray's message carries the traceback.
                raise WorkerStartError(rank, str(remote_cause(exc))) from exc
            descriptions.append(description)
        return descriptions

    def stop(self, grace: float) -> None:
        """Let the workers release their pipelines (up to ``grace`` seconds), then end
        the actors and the reservation. Safe to call more than once."""
        actors, self.actors = self.actors, []
        if actors and grace > 0:
            shutdowns = [actor.shutdown.remote() for actor in actors]
            ray.wait(shutdowns, num_returns=len(shutdowns), timeout=grace)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        group, self.placement_group = self.placement_group, None
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # the cluster is already gone
                logger.debug("could not remove the placement group", exc_info=True)
