"""The fronts the threaded lifecycle harness drives, behind one small interface.

The harness (:mod:`~diffusion_runtime.testing.harness`) talks to a
:class:`HarnessFront`: an in-process :class:`EngineFront` (a
:class:`~diffusion_runtime.DiffusionEngine`) or a
:class:`~diffusion_runtime.testing.stage_front.StageFront` (a
:class:`~diffusion_runtime.stage.StageClient` and its child process). What
only some fronts offer is declared in :class:`FrontCapabilities`, and the
harness switches the rules and checks that need it on or off by it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineSnapshot
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.fsm.events import LifecycleEvent, TraceEvent
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.request_groups import child_request_id
from diffusion_runtime.sampling_params import SamplingParams

#: How often :meth:`EngineFront.batch_started` looks at the parents' transitions.
STARTED_POLL_S = 0.001


@attrs.frozen
class FrontCapabilities:
    """What a front offers beyond the common API.

    ``pause``: the loop can be held between two steps, so requests and aborts
    pile up and whether a request is still active can be known while it is
    held. ``snapshot``: what the scheduler and runner hold per request can
    be inspected. ``live_events``: trace events reach the harness as they
    happen (otherwise only after close, from the trace file). ``die``: the
    harness can kill the engine (or one of its workers).
    ``held_messages_together``: everything sent while the loop is held is
    applied before its next step (a stage reads what has arrived when it is
    released; a message still in flight waits for the step after).
    ``batches``: several prompts can be admitted as one parent request with a
    child per prompt (the front is a :class:`BatchFront`).
    """

    pause: bool
    snapshot: bool
    live_events: bool
    die: bool
    held_messages_together: bool
    batches: bool = False


class HarnessFront(Protocol):
    """A front under test: the public API, made callable from the harness's thread."""

    @property
    def capabilities(self) -> FrontCapabilities: ...

    @property
    def config(self) -> EngineConfig: ...

    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> str: ...

    def add_together(self, requests: Sequence[tuple[Any, SamplingParams]]) -> list[str]:
        """Admit several requests so that they can share waves."""
        ...

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def wait_until_quiet(self, timeout: float) -> None:
        """Until every admitted request has delivered its final output."""
        ...

    def kill(self) -> None: ...

    def close(self) -> None:
        """Stop the front and release everything it owns; idempotent."""
        ...

    def subscribe(self, subscriber: Callable[[TraceEvent], None]) -> None:
        """Receive trace events as they happen (with ``live_events``)."""
        ...

    def recorded_events(self) -> Iterable[TraceEvent]:
        """After :meth:`close`: the events that did not reach subscribers live."""
        ...

    def left_behind(self) -> list[str]:
        """After :meth:`close`: what the front started and did not release."""
        ...


@runtime_checkable
class BatchFront(HarnessFront, Protocol):
    """A front with batch requests (``capabilities.batches``): one parent request
    over a child request per prompt, whose one final output the caller awaits."""

    async def add_batch(
        self, prompts: Sequence[Any], params: SamplingParams, request_id: str
    ) -> RequestOutput:
        """Admit ``prompts`` as one batch and return the parent's final output."""
        ...

    def child_ids(self, request_id: str, count: int) -> list[str]:
        """The ids of the children of batch ``request_id``, in prompt order."""
        ...

    def abort_batch(self, request_id: str) -> bool:
        """Abort a batch parent; return whether it was active (not finished) then."""
        ...

    def batch_events(self) -> list[LifecycleEvent]:
        """Every transition of the batch parents so far, in order."""
        ...

    async def batch_started(self, request_id: str) -> None:
        """Until batch ``request_id`` has left ``WAITING`` (its children are admitted,
        or it ended first)."""
        ...

    async def batch_sent(self, request_id: str) -> None:
        """Until the front has handed batch ``request_id`` on (its admission is sent,
        or was refused): what the front does before its caller regains control
        (the engine validates off its event loop on worker processes)."""
        ...

    def unfinished_ids(self) -> frozenset[str]:
        """The requests whose final output has not reached the front (a batch's
        children by their own ids)."""
        ...


def admit_while_held(
    front: HarnessFront,
    loop: asyncio.AbstractEventLoop,
    requests: Sequence[tuple[Any, SamplingParams]],
    *,
    already_held: bool,
) -> list[str]:
    """Admit ``requests`` through ``front`` on ``loop`` with its loop held between two
    steps: held here and released after, unless the caller holds it already."""
    if not already_held:
        front.pause()
    try:
        return [loop.run_until_complete(front.add_request(*r)) for r in requests]
    finally:
        if not already_held:
            front.resume()


class EngineFront:
    """A :class:`DiffusionEngine` in this process: every capability (``die`` when a
    ``worker_killer`` is given). Its batches are the engine's grouped requests
    (``add_request(prompts=[...])``), a :class:`BatchFront`."""

    def __init__(
        self,
        engine: DiffusionEngine,
        loop: asyncio.AbstractEventLoop,
        worker_killer: Callable[[DiffusionEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._worker_killer = worker_killer
        self._paused = False
        self.capabilities = FrontCapabilities(
            pause=True,
            snapshot=True,
            live_events=True,
            die=worker_killer is not None,
            held_messages_together=True,
            batches=True,
        )
        self._batch_events: list[LifecycleEvent] = []
        self._batches_sent: dict[str, asyncio.Event] = {}
        engine.groups.machine.subscribe(self._on_batch_event)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> str:
        return await self.engine.add_request(prompt, params, request_id=request_id)

    def add_together(self, requests: Sequence[tuple[Any, SamplingParams]]) -> list[str]:
        """Admitted while the loop is held (unless the caller holds it already)."""
        return admit_while_held(self, self._loop, requests, already_held=self._paused)

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.stream(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def add_batch(
        self, prompts: Sequence[Any], params: SamplingParams, request_id: str
    ) -> RequestOutput:
        sent = self._batches_sent.setdefault(request_id, asyncio.Event())
        try:
            rid = await self.engine.add_request(
                prompts=list(prompts), params=params, request_id=request_id
            )
        finally:  # admitted or refused: nothing more to wait for
            sent.set()
        outputs = [output async for output in self.engine.stream(rid)]
        return outputs[-1]

    async def batch_sent(self, request_id: str) -> None:
        """Until the engine admitted (or refused) the batch: on worker processes its
        validation runs off the event loop, so that takes more than one turn."""
        await self._batches_sent.setdefault(request_id, asyncio.Event()).wait()
        del self._batches_sent[request_id]

    def child_ids(self, request_id: str, count: int) -> list[str]:
        return [child_request_id(request_id, index) for index in range(count)]

    def abort_batch(self, request_id: str) -> bool:
        """Abort a grouped request; whether it was active is decided under the lock
        its children's ends take, so no end races the answer."""
        return self.engine.groups.abort(request_id, "aborted by the caller")

    def batch_events(self) -> list[LifecycleEvent]:
        return list(self._batch_events)

    async def batch_started(self, request_id: str) -> None:
        """The engine starts a parent as it admits it; this waits for the admission."""
        while not any(
            e.request_id == request_id and e.source is RequestStatus.WAITING
            for e in list(self._batch_events)
        ):
            await asyncio.sleep(STARTED_POLL_S)

    def unfinished_ids(self) -> frozenset[str]:
        return self.engine.unfinished_request_ids

    def _on_batch_event(self, event: TraceEvent) -> None:
        if isinstance(event, LifecycleEvent):
            self._batch_events.append(event)

    def pause(self) -> None:
        self.engine.pause()
        self._paused = True

    def resume(self) -> None:
        self.engine.resume()
        self._paused = False

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def wait_until_quiet(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.snapshot().scheduler_ids or self.engine.queue_length:
            assert time.monotonic() < deadline, "the engine did not finish its requests"
            time.sleep(0.001)

    def kill(self) -> None:
        assert self._worker_killer is not None, "no worker_killer was given"
        self._worker_killer(self.engine)

    def close(self) -> None:
        self.engine.close()

    def subscribe(self, subscriber: Callable[[TraceEvent], None]) -> None:
        self.engine.machine.subscribe(subscriber)

    def recorded_events(self) -> Iterable[TraceEvent]:
        return ()

    def left_behind(self) -> list[str]:
        return []  # the engine's own tests and fixtures check its threads and workers
