"""Trace events: the record every transition and every step of execution leaves behind.

Every event has a ``kind``, a monotonic ``time`` and a JSON form; the auditor
checks the runtime's invariants over a stream of them, online or from a file.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs

from diffusion_runtime.fsm.states import RequestStatus

#: The pseudo-trigger recorded when a request enters the machine.
ADMIT = "admit"


@attrs.frozen(slots=True)
class LifecycleEvent:
    """One transition of one request.

    ``source`` is ``None`` for admission. ``wave_id`` names the scheduler output
    the transition belongs to, when there is one. ``time`` is
    ``time.monotonic()`` at the moment of the transition. ``rejected`` marks an
    attempted transition the machine refused (the state did not change).
    """

    request_id: str
    source: RequestStatus | None
    dest: RequestStatus
    trigger: str
    wave_id: int | None
    time: float
    reason: str | None = None
    rejected: bool = False

    kind = "lifecycle"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "request_id": self.request_id,
            "source": None if self.source is None else self.source.value,
            "dest": self.dest.value,
            "trigger": self.trigger,
            "wave_id": self.wave_id,
            "time": self.time,
            "reason": self.reason,
            "rejected": self.rejected,
        }


@attrs.frozen(slots=True)
class WaveEvent:
    """A scheduler output: what the scheduler asked the workers to run (INV-002).

    The policy fields (INV-007, INV-009) are aligned with :attr:`scheduled_ids`:
    ``batch_keys`` holds each request's compatibility key (text in a trace file) and
    ``num_steps`` its requested step count. ``capacity`` is the engine's
    ``max_num_seqs`` and ``mode`` its execution mode (``""``/``0``: not recorded).
    """

    wave_id: int
    new_ids: tuple[str, ...]
    cached_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    time: float
    batch_keys: tuple[Hashable, ...] = ()
    num_steps: tuple[int, ...] = ()
    capacity: int = 0
    mode: str = ""

    kind = "wave"

    @property
    def scheduled_ids(self) -> tuple[str, ...]:
        return self.cached_ids + self.new_ids

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "wave_id": self.wave_id,
            "new_ids": list(self.new_ids),
            "cached_ids": list(self.cached_ids),
            "finished_ids": list(self.finished_ids),
            "time": self.time,
            "batch_keys": [k if isinstance(k, str) else repr(k) for k in self.batch_keys],
            "num_steps": list(self.num_steps),
            "capacity": self.capacity,
            "mode": self.mode,
        }


@attrs.frozen(slots=True)
class RunnerEvent:
    """What a worker's runner did for one scheduler output.

    ``executed``: ids handed to the pipeline, in order. ``produced``: ids with
    final images; ``progressed``: ids that advanced a step; ``failed``: ids with
    an error. ``created``/``released``: ids whose runner state was created or
    dropped. ``steps`` is aligned with ``progressed``: each id's
    ``(step_index, num_steps)`` after the step (INV-009). ``cached_steps``:
    the ids whose steps in this wave reused a cached model output instead of
    running the model (a step cache), each with how many (one per step in
    step mode; a request-mode forward may skip several).
    """

    wave_id: int
    executed: tuple[str, ...]
    produced: tuple[str, ...]
    progressed: tuple[str, ...]
    failed: tuple[str, ...]
    created: tuple[str, ...]
    released: tuple[str, ...]
    time: float
    steps: tuple[tuple[int, int], ...] = ()
    cached_steps: tuple[tuple[str, int], ...] = ()

    kind = "runner"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "wave_id": self.wave_id,
            "executed": list(self.executed),
            "produced": list(self.produced),
            "progressed": list(self.progressed),
            "failed": list(self.failed),
            "created": list(self.created),
            "released": list(self.released),
            "time": self.time,
            "steps": [list(step) for step in self.steps],
            "cached_steps": [list(item) for item in self.cached_steps],
        }


@attrs.frozen(slots=True)
class DeliveryEvent:
    """An output the engine core emitted for a request (a value ``step()`` returned).

    ``digest`` fingerprints the images (empty when there are none), and
    ``fingerprint`` the request's inputs (prompt, seed, parameters): two
    deliveries with equal fingerprints must carry equal digests (INV-005).
    """

    request_id: str
    status: RequestStatus
    finished: bool
    digest: str
    fingerprint: str
    time: float

    kind = "delivery"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "request_id": self.request_id,
            "status": self.status.value,
            "finished": self.finished,
            "digest": self.digest,
            "fingerprint": self.fingerprint,
            "time": self.time,
        }


@attrs.frozen(slots=True)
class ResourceEvent:
    """A per-request resource (executor bookkeeping, a shared-memory segment) taken or freed."""

    request_id: str
    resource: str
    acquired: bool
    time: float

    kind = "resource"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "request_id": self.request_id,
            "resource": self.resource,
            "acquired": self.acquired,
            "time": self.time,
        }


@attrs.frozen(slots=True)
class AbortEvent:
    """A caller (or a consumer that stopped reading) asked the core to abort a request (INV-008)."""

    request_id: str
    reason: str
    time: float

    kind = "abort"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "request_id": self.request_id,
            "reason": self.reason,
            "time": self.time,
        }


@attrs.frozen(slots=True)
class EngineEvent:
    """The engine started, closed or died; a trace that ends with ``closed`` is complete."""

    state: str
    time: float
    reason: str | None = None

    kind = "engine"

    def to_json_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": self.state, "time": self.time, "reason": self.reason}


@attrs.frozen(slots=True)
class AdapterEvent:
    """The core's table of LoRA adapters changed, or a request took an adapter.

    ``action`` is ``loaded``, ``evicted`` (to make room), ``removed`` (by a
    caller), ``pinned``, ``used`` (``request_id`` is admitted with it) or
    ``refused`` (``request_id`` was refused at admission: its adapter could not
    be loaded). ``max_loras`` and ``max_cpu_loras`` are the engine's limits
    (INV-013..015).
    """

    action: str
    adapter_id: int
    time: float
    request_id: str | None = None
    max_loras: int = 0
    max_cpu_loras: int = 0

    kind = "adapter"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "action": self.action,
            "adapter_id": self.adapter_id,
            "time": self.time,
            "request_id": self.request_id,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_cpu_loras,
        }


TraceEvent = (
    LifecycleEvent
    | WaveEvent
    | RunnerEvent
    | DeliveryEvent
    | ResourceEvent
    | AbortEvent
    | EngineEvent
    | AdapterEvent
)


def event_from_json(record: dict[str, Any]) -> TraceEvent:
    """Rebuild an event from its JSON form (a line of a trace file)."""
    kind = record.get("kind")
    fields = {k: v for k, v in record.items() if k != "kind"}
    if kind == "lifecycle":
        source = fields["source"]
        fields["source"] = None if source is None else RequestStatus(source)
        fields["dest"] = RequestStatus(fields["dest"])
        return LifecycleEvent(**fields)
    if kind == "wave":
        return WaveEvent(
            fields["wave_id"],
            tuple(fields["new_ids"]),
            tuple(fields["cached_ids"]),
            tuple(fields["finished_ids"]),
            fields["time"],
            batch_keys=tuple(fields.get("batch_keys", ())),
            num_steps=tuple(fields.get("num_steps", ())),
            capacity=fields.get("capacity", 0),
            mode=fields.get("mode", ""),
        )
    if kind == "runner":
        return RunnerEvent(
            wave_id=fields["wave_id"],
            executed=tuple(fields["executed"]),
            produced=tuple(fields["produced"]),
            progressed=tuple(fields["progressed"]),
            failed=tuple(fields["failed"]),
            created=tuple(fields["created"]),
            released=tuple(fields["released"]),
            time=fields["time"],
            steps=tuple((step, total) for step, total in fields.get("steps", ())),
            cached_steps=tuple((rid, count) for rid, count in fields.get("cached_steps", ())),
        )
    if kind == "delivery":
        fields["status"] = RequestStatus(fields["status"])
        return DeliveryEvent(**fields)
    if kind == "resource":
        return ResourceEvent(**fields)
    if kind == "abort":
        return AbortEvent(**fields)
    if kind == "engine":
        return EngineEvent(**fields)
    if kind == "adapter":
        return AdapterEvent(**fields)
    raise ValueError(f"unknown trace event kind {kind!r}")
