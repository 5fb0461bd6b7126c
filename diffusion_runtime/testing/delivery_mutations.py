"""Bugs of the two-phase output path: outputs that leave before their copies
land, progress that outlives its request, copies lost at shutdown or
forgotten by a core that says it has nothing left to do.

On the CPU every fence is ready when its wave returns, so each of these
passes a harness that does not hold copies in flight; the core harness holds
them (:mod:`~diffusion_runtime.testing.copies_in_flight`) and must catch each.
"""

from __future__ import annotations

from typing import Any

from diffusion_runtime.core import EngineCore
from diffusion_runtime.delivery_queue import DeliveryQueue
from diffusion_runtime.fsm import LifecycleEvent
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute as _replace


def progress_outlives_its_request() -> Patch:
    def make(original: Any) -> Any:
        def drop(self: EngineCore, request: Request, event: LifecycleEvent) -> None:
            # "a progress output already produced is harmless: deliver it"
            return None

        return drop

    return _replace(EngineCore, "_drop_intermediate_outputs", make)


def delivery_ignores_the_fence() -> Patch:
    def make(original: Any) -> Any:
        def take(self: DeliveryQueue[Any], *, wait: bool) -> list[Any]:
            taken: list[Any] = []
            while self._batches:  # "the copy was started: the tensors are as good as there"
                _, batch = self._batches.popleft()
                taken.extend(batch)
            return taken

        return take

    return _replace(DeliveryQueue, "take", make)


def shutdown_drops_copies_in_flight() -> Patch:
    def make(original: Any) -> Any:
        def delivered(self: EngineCore, *, wait: bool) -> list[RequestOutput]:
            if self._shut_down:
                wait = False  # "never block a shutdown on a device copy"
            result: list[RequestOutput] = original(self, wait=wait)
            return result

        return delivered

    return _replace(EngineCore, "_delivered", make)


def unfinished_ignores_copies_in_flight() -> Patch:
    def make(original: Any) -> Any:
        def has_unfinished(self: EngineCore) -> bool:
            # "outputs already made are the front's business, not work for a step"
            return (
                self._inbox.has_input()
                or self.scheduler.has_unfinished_requests()
                or bool(self._pending)
                or self.scheduler.has_pending_release()
            )

        return has_unfinished

    return _replace(EngineCore, "has_unfinished", make)


DELIVERY_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="progress-outlives-its-request", mode="step", target="core",
             bug="progress of a request still being copied is delivered after its end",
             patch=progress_outlives_its_request),
    Mutation(name="delivery-ignores-the-fence", mode="request", target="core",
             bug="outputs leave before their copies land",
             patch=delivery_ignores_the_fence),
    Mutation(name="shutdown-drops-copies", mode="request", target="core",
             bug="shutdown does not wait for copies in flight (their outputs are lost)",
             patch=shutdown_drops_copies_in_flight),
    Mutation(name="unfinished-ignores-copies", mode="request", target="core",
             bug="a core with outputs still being copied says it has nothing left to do",
             patch=unfinished_ignores_copies_in_flight),
)  # fmt: skip
