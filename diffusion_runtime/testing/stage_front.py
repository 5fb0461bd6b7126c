"""The stage as a target of the threaded lifecycle harness (``target="stage"``).

A :class:`StageFront` starts a :class:`~diffusion_runtime.stage.StageClient`
(and so a stage process) on the harness's event loop, with the child's core
writing its trace to a private file. The child's events cannot reach the
harness while it runs, so they are read from that file once the stage has
shut down and audited then. The stage is held between steps with a test
worker extension (:mod:`~diffusion_runtime.testing.stage_hold`); it has no
snapshot of what its core holds and sends no live events: those capabilities
are off, and the harness leaves out the rules and checks that need them (the
offline audit covers cleanup, INV-003, and the effect of aborts, INV-008).
Batch parents live in the client: their transitions reach the harness as they
happen (``capabilities.batches``, a :class:`BatchFront`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.core import EngineSnapshot
from diffusion_runtime.errors import EngineClosedError, EngineDeadError
from diffusion_runtime.fsm import LifecycleEvent, RequestStatus
from diffusion_runtime.fsm.events import TraceEvent
from diffusion_runtime.fsm.trace import read_trace
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.request_groups import child_request_id
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.stage import StageClient
from diffusion_runtime.testing.fronts import FrontCapabilities, admit_while_held
from diffusion_runtime.testing.leaks import Leftovers
from diffusion_runtime.testing.stage_hold import StageHold, StageHolder

#: How often a quiescence wait looks at the client's unfinished requests.
QUIET_POLL_S = 0.001
#: The longest wait for the stage to reach a hold, or to answer once released.
HOLD_TIMEOUT_S = 30.0


class StageFront:
    """A :class:`StageClient` driven from the harness's thread: it can be held
    between steps and killed (SIGTERM to the stage process), not inspected; it
    admits batch requests (a :class:`~diffusion_runtime.testing.fronts.BatchFront`)."""

    capabilities = FrontCapabilities(
        pause=True,
        snapshot=False,
        live_events=False,
        die=True,
        held_messages_together=False,
        batches=True,
    )

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._leftovers = Leftovers.baseline()
        self._trace_dir = tempfile.mkdtemp(prefix="diffusion-stage-trace-")
        self._trace_path = Path(config.trace_path or Path(self._trace_dir, "trace.jsonl"))
        self._config = attrs.evolve(
            config,
            trace_path=str(self._trace_path),
            worker_extensions=(*config.worker_extensions, StageHold),
        )
        self._events: list[TraceEvent] = []
        self._closed = False
        #: Admissions sent while the stage is held: answered once it is released.
        self._pending: list[asyncio.Task[str]] = []
        self._held_ids = (f"held-{n}" for n in itertools.count())
        #: The batch parents' transitions, and who waits for a parent to leave WAITING.
        self._batch_events: list[LifecycleEvent] = []
        self._batch_waiters: dict[str, asyncio.Future[None]] = {}
        try:
            self.client = StageClient(self._config)
            loop.run_until_complete(self.client.start())
        except BaseException:
            shutil.rmtree(self._trace_dir, ignore_errors=True)
            raise
        self._holder = StageHolder(self.client, loop)
        self.client.batch_machine.subscribe(self._on_batch_event)

    @property
    def config(self) -> EngineConfig:
        return self._config

    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Admit a request; while the stage is held, return its id at once (the
        front names it) and leave the stage's answer for :meth:`resume`."""
        if not self._holder.held:
            return await self.client.add_request(prompt, params, request_id=request_id)
        request_id = request_id or next(self._held_ids)
        admission = asyncio.ensure_future(self.client.add_request(prompt, params, request_id))
        self._pending.append(admission)
        await asyncio.sleep(0)  # the admission is sent, and its stream exists
        if admission.done():  # refused before it was sent: raise why, here only
            self._pending.remove(admission)
            admission.result()
        return request_id

    def add_together(self, requests: Sequence[tuple[Any, SamplingParams]]) -> list[str]:
        """Sent while the stage is held (unless the caller holds it already), so the
        stage reads them between the same two steps."""
        return admit_while_held(self, self._loop, requests, already_held=self._holder.held)

    def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        return self.client.stream(request_id)

    def abort(self, request_id: str) -> None:
        async def abort() -> None:
            self.client.abort(request_id)

        self._loop.run_until_complete(abort())

    async def add_batch(
        self, prompts: Sequence[Any], params: SamplingParams, request_id: str
    ) -> RequestOutput:
        return await self.client.add_batch_request(prompts, params, request_id)

    def child_ids(self, request_id: str, count: int) -> list[str]:
        return [child_request_id(request_id, index) for index in range(count)]

    async def batch_sent(self, request_id: str) -> None:
        """One turn of the loop: the client sends the admission on its first turn."""
        await asyncio.sleep(0)

    def abort_batch(self, request_id: str) -> bool:
        """Abort a batch parent; return whether it was active when the abort was made
        (read in the same turn of the loop as the abort)."""

        async def abort() -> bool:
            events = [e for e in self._batch_events if e.request_id == request_id]
            active = bool(events) and not events[-1].dest.is_finished
            self.client.abort(request_id)
            return active

        return self._loop.run_until_complete(abort())

    def batch_events(self) -> list[LifecycleEvent]:
        return list(self._batch_events)

    async def batch_started(self, request_id: str) -> None:
        if any(
            e.request_id == request_id and e.source is RequestStatus.WAITING
            for e in self._batch_events
        ):
            return
        waiter = self._batch_waiters.setdefault(request_id, self._loop.create_future())
        await waiter

    def unfinished_ids(self) -> frozenset[str]:
        return self.client.unfinished_request_ids

    def _on_batch_event(self, event: TraceEvent) -> None:
        if not isinstance(event, LifecycleEvent):
            return
        self._batch_events.append(event)
        if event.source is RequestStatus.WAITING and not event.rejected:
            waiter = self._batch_waiters.pop(event.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def pause(self) -> None:
        self._holder.hold(HOLD_TIMEOUT_S)

    def resume(self) -> None:
        """Release the stage and wait for its answers to what was sent meanwhile."""
        self._let_go()
        self._settle_admissions()

    def snapshot(self) -> EngineSnapshot:
        raise RuntimeError("a stage has no snapshot of its core (capabilities.snapshot)")

    def wait_until_quiet(self, timeout: float) -> None:
        async def quiet() -> None:
            while self.client.unfinished_request_ids:
                await asyncio.sleep(QUIET_POLL_S)

        try:
            self._loop.run_until_complete(asyncio.wait_for(quiet(), timeout))
        except TimeoutError:
            raise AssertionError(
                f"the stage did not finish its requests within {timeout} s: "
                f"{sorted(self.client.unfinished_request_ids)}"
            ) from None

    def kill(self) -> None:
        """Stop the stage process with SIGTERM: it reports its death and its core
        shuts down, so its trace ends complete. A held stage gets the signal
        first: once released, it reads what was sent meanwhile, runs one step
        and dies, so requests admitted while it was held die mid-flight."""
        pid = self.client.pid
        assert pid is not None, "the stage is started before it is killed"
        os.kill(pid, signal.SIGTERM)
        self._let_go()  # the admissions sent while held are settled by resume() or close()

    def close(self) -> None:
        """Shut the stage down, read its trace and remove the trace's directory."""
        if self._closed:
            return
        self._closed = True
        try:
            self._let_go()
            self._loop.run_until_complete(self.client.shutdown())
            self._settle_admissions()
            if self._trace_path.exists():
                self._events = list(read_trace(self._trace_path))
        finally:
            self._holder.close()
            shutil.rmtree(self._trace_dir, ignore_errors=True)

    def subscribe(self, subscriber: Callable[[TraceEvent], None]) -> NoReturn:
        raise RuntimeError(
            "no live events cross from the stage process (capabilities.live_events); "
            "read recorded_events() after close()"
        )

    def _let_go(self) -> None:
        """Release a held stage (a held stage reads no message and acts on no signal)."""
        if not self._holder.held:
            return
        # A stage that ended while held answers nothing any more.
        with contextlib.suppress(EngineDeadError, EngineClosedError):
            self._holder.release(HOLD_TIMEOUT_S)

    def _settle_admissions(self) -> None:
        """Collect the admissions sent while held; raise the first refusal, unless
        the stage ended first (then they fail as every pending call does)."""
        pending, self._pending = self._pending, []
        results = self._loop.run_until_complete(_all_of(pending))
        for result in results:
            if isinstance(result, Exception) and not isinstance(
                result, (EngineDeadError, EngineClosedError)
            ):
                raise result

    def recorded_events(self) -> Iterable[TraceEvent]:
        return self._events

    def left_behind(self) -> list[str]:
        return self._leftovers.since()


async def _all_of(tasks: list[asyncio.Task[str]]) -> list[str | BaseException]:
    return await asyncio.gather(*tasks, return_exceptions=True)
