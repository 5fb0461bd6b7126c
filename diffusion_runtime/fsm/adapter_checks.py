"""INV-013..015: the LoRA adapter invariants, checked from the core's adapter events.

Each checker follows the adapter table from :class:`AdapterEvent`\\ s (loaded,
evicted, removed, pinned) and which open request uses which adapter (``used``
at admission, until the request's terminal transition), and checks one rule
of ``docs/lora.md``.
"""

from __future__ import annotations

from diffusion_runtime.fsm.events import AdapterEvent, LifecycleEvent, TraceEvent, WaveEvent
from diffusion_runtime.fsm.states import TERMINAL_STATES
from diffusion_runtime.fsm.violation import Violation


class _AdapterView:
    """The adapter table and the open requests' adapters, as the trace tells them."""

    invariant = ""
    events: tuple[type, ...] = (AdapterEvent, LifecycleEvent)

    def __init__(self) -> None:
        self.loaded: dict[int, AdapterEvent] = {}
        self.pinned: set[int] = set()
        #: Open requests' adapters: request id → its ``used`` event.
        self.users: dict[str, AdapterEvent] = {}

    def feed(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, LifecycleEvent):
            if event.dest in TERMINAL_STATES and not event.rejected:
                self.users.pop(event.request_id, None)
            return []
        problems = self.check(event)
        if isinstance(event, AdapterEvent):
            self._apply(event)
        return problems

    def check(self, event: TraceEvent) -> list[Violation]:
        """The violations ``event`` reveals, judged against the state before it."""
        return []

    def users_of(self, adapter_id: int) -> list[AdapterEvent]:
        return [used for used in self.users.values() if used.adapter_id == adapter_id]

    def finish(self, complete: bool) -> list[Violation]:
        return []

    def _apply(self, event: AdapterEvent) -> None:
        if event.action == "loaded":
            self.loaded[event.adapter_id] = event
        elif event.action in ("evicted", "removed"):
            self.loaded.pop(event.adapter_id, None)
            self.pinned.discard(event.adapter_id)
        elif event.action == "pinned":
            self.pinned.add(event.adapter_id)
        elif event.action == "used" and event.request_id is not None:
            self.users[event.request_id] = event

    def _violation(self, rid: str | None, message: str, *events: TraceEvent) -> Violation:
        return Violation(self.invariant, rid, message, events)


class AdaptersWithinLimits(_AdapterView):
    """At most ``max_cpu_loras`` adapters are loaded; a wave uses at most
    ``max_loras`` distinct adapters, all loaded; a request is admitted only with a
    loaded adapter; a load is refused only when no loaded adapter may be evicted."""

    invariant = "INV-013"
    rule = (
        "loaded adapters stay within max_cpu_loras and a wave's within max_loras; "
        "a load is refused only when every loaded adapter is pinned or in use"
    )
    events = (AdapterEvent, LifecycleEvent, WaveEvent)

    def check(self, event: TraceEvent) -> list[Violation]:
        if isinstance(event, WaveEvent):
            return self._wave(event)
        assert isinstance(event, AdapterEvent)
        rid = event.request_id
        if event.action == "loaded" and len(self.loaded | {event.adapter_id: event}) > (
            event.max_cpu_loras
        ):
            message = (
                f"adapter {event.adapter_id} loaded beside {sorted(self.loaded)}: more than "
                f"max_cpu_loras ({event.max_cpu_loras})"
            )
            return [self._violation(None, message, event)]
        if event.action == "used" and event.adapter_id not in self.loaded:
            return [
                self._violation(rid, f"admitted with adapter {event.adapter_id}, not loaded", event)
            ]
        if event.action == "refused":
            busy = self.pinned | {used.adapter_id for used in self.users.values()}
            free = sorted(set(self.loaded) - busy)
            if len(self.loaded) < event.max_cpu_loras or free:
                message = (
                    f"refused adapter {event.adapter_id} with room to load it "
                    f"(loaded {sorted(self.loaded)}, evictable {free})"
                )
                return [self._violation(rid, message, event)]
        return []

    def _wave(self, wave: WaveEvent) -> list[Violation]:
        used = {rid: self.users[rid] for rid in wave.scheduled_ids if rid in self.users}
        if not used:
            return []
        problems = [
            self._violation(
                rid, f"in wave {wave.wave_id} with adapter {u.adapter_id}, not loaded", u, wave
            )
            for rid, u in used.items()
            if u.adapter_id not in self.loaded
        ]
        distinct = sorted({u.adapter_id for u in used.values()})
        limit = next(iter(used.values())).max_loras
        if len(distinct) > limit:
            message = f"wave {wave.wave_id} uses adapters {distinct}: more than max_loras ({limit})"
            problems.append(self._violation(None, message, wave))
        return problems


class PinnedAdaptersStay(_AdapterView):
    """A pinned adapter is never evicted (a caller's ``remove_lora`` may unload it)."""

    invariant = "INV-014"
    rule = "a pinned adapter is never evicted"

    def check(self, event: TraceEvent) -> list[Violation]:
        if (
            isinstance(event, AdapterEvent)
            and event.action == "evicted"
            and event.adapter_id in self.pinned
        ):
            return [self._violation(None, f"pinned adapter {event.adapter_id} evicted", event)]
        return []


class AdaptersInUseStay(_AdapterView):
    """An adapter that a waiting, running or preempted request uses is never
    evicted or removed."""

    invariant = "INV-015"
    rule = "an adapter in use by an active request is never evicted or removed"

    def check(self, event: TraceEvent) -> list[Violation]:
        if not isinstance(event, AdapterEvent) or event.action not in ("evicted", "removed"):
            return []
        return [
            self._violation(
                used.request_id,
                f"adapter {event.adapter_id} {event.action} while this request uses it",
                used,
                event,
            )
            for used in self.users_of(event.adapter_id)
        ]
