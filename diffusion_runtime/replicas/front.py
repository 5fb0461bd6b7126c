"""ReplicaSet: the engine's request API over N replicas, each an engine in a Ray actor."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import Any

import attrs
import ray

from diffusion_runtime.admission import RequestMinter
from diffusion_runtime.engine import EngineSnapshot
from diffusion_runtime.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
)
from diffusion_runtime.executor.ray.connection import RayConnection
from diffusion_runtime.executor.ray.failures import is_lost_worker, remote_cause
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.replicas.config import ReplicaSetConfig
from diffusion_runtime.replicas.heartbeat import Heartbeat
from diffusion_runtime.replicas.replica import EngineReplica
from diffusion_runtime.replicas.router import LoadRouter
from diffusion_runtime.sampling_params import SamplingParams, checked_params
from diffusion_runtime.sampling_params import prompts_and_params as split_prompts

logger = logging.getLogger(__name__)

# How long close() lets each replica close its engine before its actor is killed.
_CLOSE_GRACE_S = 10.0


@attrs.frozen
class ReplicaSetSnapshot:
    """Each replica's engine snapshot by index (None for a dead replica), and the front's
    own bookkeeping: the ids it routed and has not seen finish, and each replica's load."""

    replicas: tuple[EngineSnapshot | None, ...]
    routed_ids: frozenset[str]
    loads: tuple[int, ...]


class ReplicaSet:
    """``generate``, ``add_request``/``stream``, ``abort``, ``snapshot`` and ``close``
    as on :class:`DiffusionEngine`, over ``num_replicas`` engines.

    Each request goes to one replica chosen by load (see :class:`LoadRouter`)
    and stays there. When a replica dies, only its requests fail: each ends
    with a final output of status ``FINISHED_ERROR`` naming the replica, and is
    not retried elsewhere (a request runs at most once). The other replicas
    keep serving; the set is dead (:class:`EngineDeadError`) once all are.
    """

    def __init__(self, config: ReplicaSetConfig) -> None:
        if not isinstance(config, ReplicaSetConfig):
            raise TypeError(f"config must be a ReplicaSetConfig; got {type(config).__name__}")
        self.config = config
        self._closed = False
        self._lock = threading.Lock()
        self._owner: dict[str, tuple[int, int]] = {}  # id -> (replica, seed)
        self._minter = RequestMinter()
        self._router = LoadRouter(config.num_replicas, config.routing)
        RayConnection.acquire(config.ray_address)
        actor_class = ray.remote(EngineReplica)
        self._replicas: list[Any] = []
        try:
            self._replicas = [
                actor_class.options(
                    num_cpus=config.replica_cpus, num_gpus=config.replica_gpus, max_restarts=0
                ).remote(config.engine)
                for _ in range(config.num_replicas)
            ]
            started = [replica.load.remote() for replica in self._replicas]
            ray.get(started, timeout=config.start_timeout_s)
        except BaseException:
            self._kill_all()
            RayConnection.release()
            raise
        self._heartbeat = Heartbeat(
            self._replicas,
            self._router,
            config.heartbeat_interval_s,
            config.heartbeat_timeout_s,
            self._on_replica_death,
        )
        self._heartbeat.start()

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[Any] | tuple[Any, ...] | Any,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[RequestOutput]:
        """As :meth:`DiffusionEngine.generate`; each prompt is routed on its own."""
        prompt_list, params_list = split_prompts(prompts, params)
        requests = [
            self._prepare(p, params, None)
            for p, params in zip(prompt_list, params_list, strict=True)
        ]
        calls = []
        for prompt, request_params, request_id in requests:
            index = self._route(request_id, request_params)
            calls.append(
                (index, self._replicas[index].generate.remote(prompt, request_params, request_id))
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        outputs = []
        try:
            for (index, ref), (_, request_params, request_id) in zip(calls, requests, strict=True):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                outputs.append(self._final(index, ref, request_id, request_params, remaining))
        except BaseException:
            self.abort([request_id for _, _, request_id in requests], "generate call failed")
            raise
        return outputs

    async def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Admit one request on a replica and return its id; read it with :meth:`stream`.

        A replica found dead while admitting never held the request, so the
        request goes to another one.
        """
        prompt, checked, request_id = self._prepare(prompt, params, request_id)
        while True:
            index = self._route(request_id, checked)
            try:
                await self._replicas[index].add_request.remote(prompt, checked, request_id)
                return request_id
            except ray.exceptions.RayError as exc:
                self._forget(request_id)
                error = self._as_runtime_error(index, exc)
                if not isinstance(error, EngineDeadError):
                    raise error from exc
            except BaseException:
                self._forget(request_id)
                raise

    async def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield a request's outputs until its final one (a failed final output if its
        replica dies). Stopping early aborts the request."""
        with self._lock:
            owner = self._owner.get(request_id)
        if owner is None:
            raise KeyError(f"no unclaimed output stream for request {request_id!r}")
        index, seed = owner
        finished = False
        try:
            async for output in self._outputs_of(index, seed, request_id):
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id, "the consumer stopped reading")
            self._forget(request_id)

    async def _outputs_of(
        self, index: int, seed: int, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """The replica's outputs for a request; a failed final one if the replica dies."""
        try:
            refs = self._replicas[index].stream.options(num_returns="streaming").remote(request_id)
            async for ref in refs:
                yield await ref
        except ray.exceptions.RayError as exc:
            error = self._as_runtime_error(index, exc)
            if not isinstance(error, EngineDeadError):
                raise error from exc
            yield _failed(request_id, seed, str(error))

    def abort(
        self, request_ids: str | Iterable[str], reason: str = "aborted by the caller"
    ) -> None:
        """Abort requests on their replicas; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in ids:
                owner = self._owner.get(request_id)
                if owner is not None:
                    by_replica.setdefault(owner[0], []).append(request_id)
        live = self._router.live()
        for index, targets in by_replica.items():
            if index in live:
                self._replicas[index].abort.remote(targets, reason)

    # -- state ---------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise :class:`EngineClosedError` once closed, :class:`EngineDeadError` once
        every replica is dead."""
        if self._closed:
            raise EngineClosedError("the replica set was closed")
        if not self._router.live():
            raise EngineDeadError("every replica is dead")

    @property
    def live_replicas(self) -> frozenset[int]:
        return self._router.live()

    @property
    def replicas(self) -> Sequence[Any]:
        """The replica actor handles, by index."""
        return tuple(self._replicas)

    def snapshot(self) -> ReplicaSetSnapshot:
        live = self._router.live()
        refs = {i: self._replicas[i].snapshot.remote() for i in live}
        snapshots: list[EngineSnapshot | None] = [None] * len(self._replicas)
        for index, ref in refs.items():
            try:
                snapshots[index] = ray.get(ref, timeout=self.config.heartbeat_timeout_s)
            except ray.exceptions.RayError as exc:
                self._on_replica_death(index, f"replica {index} failed a snapshot: {exc}")
        with self._lock:
            routed = frozenset(self._owner)
        return ReplicaSetSnapshot(tuple(snapshots), routed, tuple(self._router.loads()))

    def close(self) -> None:
        """Close every replica's engine, end the actors, leave Ray. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._heartbeat.stop()
        closing = [self._replicas[i].close.remote() for i in self._router.live()]
        ray.wait(closing, num_returns=len(closing), timeout=_CLOSE_GRACE_S)
        self._kill_all()
        RayConnection.release()

    # -- helpers -------------------------------------------------------------------------

    def _prepare(
        self, prompt: Any, params: SamplingParams | None, request_id: str | None
    ) -> tuple[Any, SamplingParams, str]:
        """Check what the front itself owns (the id, the params), and fix the seed here
        so that a failed output names the seed the request would have used."""
        self.check_health()
        checked = checked_params(params)
        if checked.seed is None:
            checked = attrs.evolve(checked, seed=self._minter.seed(checked))
        return prompt, checked, self._minter.request_id(request_id)

    def _route(self, request_id: str, params: SamplingParams) -> int:
        assert params.seed is not None  # fixed by _prepare
        with self._lock:
            if request_id in self._owner:
                raise DuplicateRequestError(f"request id {request_id!r} is already in use")
            index = self._router.pick()
            self._owner[request_id] = (index, params.seed)
        return index

    def _forget(self, request_id: str) -> None:
        with self._lock:
            owner = self._owner.pop(request_id, None)
        if owner is not None:
            self._router.finished(owner[0])

    def _final(
        self, index: int, ref: Any, request_id: str, params: SamplingParams, timeout: float | None
    ) -> RequestOutput:
        try:
            output: RequestOutput = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"generate timed out after {timeout} s") from None
        except ray.exceptions.RayError as exc:
            error = self._as_runtime_error(index, exc)
            if not isinstance(error, EngineDeadError):
                raise error from exc
            assert params.seed is not None
            output = _failed(request_id, params.seed, str(error))
        finally:
            self._forget(request_id)
        return output

    def _as_runtime_error(self, index: int, exc: BaseException) -> BaseException:
        cause = remote_cause(exc)
        if is_lost_worker(exc) or isinstance(cause, EngineDeadError):
            reason = f"replica {index} died: {cause}"
            self._on_replica_death(index, reason)
            return EngineDeadError(reason)
        return cause

    def _on_replica_death(self, index: int, reason: str) -> None:
        if self._router.mark_dead(index):
            logger.error("%s", reason)
            with contextlib.suppress(Exception):
                ray.kill(self._replicas[index], no_restart=True)

    def _kill_all(self) -> None:
        for replica in self._replicas:
            with contextlib.suppress(Exception):
                ray.kill(replica, no_restart=True)


def _failed(request_id: str, seed: int, error: str) -> RequestOutput:
    return RequestOutput(request_id, RequestStatus.FINISHED_ERROR, True, None, seed, error=error)
