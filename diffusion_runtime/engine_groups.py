"""The grouped requests of one in-process engine (``add_request(prompts=[...])``).

Each parent is a :class:`~diffusion_runtime.request_groups.RequestGroup`; this
table keeps them while they are active and makes them safe to reach from
several threads: the driver pushes children's outputs, callers abort. One
lock guards every parent and their shared machine; under it nothing but the
core's inbox is touched (a parent's terminal hook queues the aborts of its
children still running), so it never waits on the engine's own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from diffusion_runtime.fsm import Hook, LifecycleEvent, RequestMachine
from diffusion_runtime.outputs import RequestOutput
from diffusion_runtime.request_groups import RequestGroup
from diffusion_runtime.streams import OutputSink

#: Queues an abort of request ids in the core, with a reason.
AbortChildren = Callable[[list[str], str], None]


class EngineGroups:
    """The active parents of one engine, by id, under one lock.

    ``machine`` is the parents' lifecycle machine: ``machine.subscribe(fn)``
    receives their transitions (their children's are on the engine's own
    machine). ``wake`` is called, outside the lock, after a caller's abort
    fired, so an idle driver applies the children's aborts now.
    """

    def __init__(self, abort_children: AbortChildren, wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, RequestGroup] = {}
        self._abort_children = abort_children
        self._wake = wake
        self.machine: RequestMachine[RequestGroup] = RequestMachine()
        self.machine.add_hook(Hook.TERMINAL, self._on_end)

    @property
    def active_ids(self) -> frozenset[str]:
        """The parents whose final output is not delivered yet."""
        with self._lock:
            return frozenset(self._groups)

    def is_taken(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._groups

    def open(
        self, request_id: str, child_ids: list[str], seed: int, sink: OutputSink
    ) -> OutputSink:
        """Admit and start a parent whose children the core has just queued; its
        final output goes to ``sink``. Returns the sink of its children's outputs."""
        with self._lock:
            group = RequestGroup(request_id, child_ids, seed, self.machine, sink)
            self._groups[request_id] = group
            group.start()
        return _ChildSink(self, group)

    def abort(self, request_id: str, reason: str, sink: OutputSink | None = None) -> bool:
        """The caller's abort of parent ``request_id`` (only if its final output goes
        to ``sink``, when given); returns whether it was active. Unknown ids are ignored."""
        with self._lock:
            group = self._groups.get(request_id)
            if group is None or (sink is not None and group.sink is not sink):
                return False
            active = group.abort(reason)
            self._forget_if_delivered(group)
        if active:
            self._wake()
        return active

    def fail(self, group: RequestGroup, error: BaseException) -> None:
        with self._lock:
            group.fail(error)
            self._forget_if_delivered(group)

    def push(self, group: RequestGroup, output: RequestOutput) -> None:
        with self._lock:
            group.push(output)
            self._forget_if_delivered(group)

    def _forget_if_delivered(self, group: RequestGroup) -> None:
        if group.delivered and self._groups.get(group.request_id) is group:
            del self._groups[group.request_id]

    def _on_end(self, group: RequestGroup, event: LifecycleEvent) -> None:
        """A parent's terminal hook: abort its children still running."""
        live = group.live_child_ids
        if live:
            self._abort_children(live, event.reason or "its grouped request ended")


class _ChildSink:
    """Where the outputs of one parent's children go: to the parent, under the lock."""

    __slots__ = ("_group", "_groups")

    def __init__(self, groups: EngineGroups, group: RequestGroup) -> None:
        self._groups = groups
        self._group = group

    def push(self, output: RequestOutput) -> None:
        self._groups.push(self._group, output)

    def fail(self, error: BaseException) -> None:
        self._groups.fail(self._group, error)
