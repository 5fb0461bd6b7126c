"""The messages between the mp executor and its worker processes.

Each message is a small frozen class, pickled with the standard pickler (not
``ForkingPickler``, so torch never swaps a tensor for a file descriptor) and
sent as one length-prefixed frame over a private pipe. User data inside a
message (scheduler outputs, RPC arguments, prompts, reply values) is pickled
separately into ``payload`` bytes, so a worker that cannot unpickle it still
knows which call to fail. Image bytes never travel in a message: they cross
through shared memory (:mod:`.segments`) and the message carries their layout.

Executor → workers: :class:`Execute`, :class:`Call` (every rank), :class:`Validate`,
:class:`ReleaseSegment` (rank 0 only), :class:`Stop`.
Workers → executor: :class:`Ready` or :class:`StartFailed` once, then
:class:`Reply`, :class:`ComputeDone`, :class:`OutputReady` and :class:`Fatal`.
"""

from __future__ import annotations

import pickle
from typing import Any

import attrs

from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.executor.mp.remote_error import RemoteError


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


# -- executor → workers ----------------------------------------------------------------


@attrs.frozen
class Execute:
    """Run one scheduler output on every rank; rank 0 reports it.

    The output travels inside this message, so it is pickled once.
    """

    call_id: int
    output: SchedulerOutput


@attrs.frozen
class Call:
    """Call a worker method on every rank; ``reply_rank`` alone replies, or all if None.

    ``payload`` is ``(args, kwargs)``.
    """

    call_id: int
    method: str
    payload: bytes
    reply_rank: int | None


@attrs.frozen
class Validate:
    """Admission check of ``(prompt, params)`` on rank 0, answered without waiting for a wave."""

    call_id: int
    payload: bytes


@attrs.frozen
class ReleaseSegment:
    """The executor has copied (or dropped) what it read from this output segment."""

    name: str


@attrs.frozen
class Stop:
    """Finish the current command, release everything and exit."""


# -- workers → executor ----------------------------------------------------------------


@attrs.frozen
class Ready:
    """The worker built its pipeline and is serving. ``validates``: the pipeline
    has a ``validate_request`` (otherwise admission needs no round trip)."""

    rank: int
    pid: int
    device: str
    validates: bool


@attrs.frozen
class StartFailed:
    rank: int
    error: RemoteError


@attrs.frozen
class Reply:
    """The outcome of a call on ``rank``: a pickled value, or the error it raised."""

    call_id: int
    rank: int
    value: bytes = b""
    error: RemoteError | None = None


@attrs.frozen
class ComputeDone:
    """Rank 0 finished the forward of wave ``call_id``; its device is free."""

    call_id: int


@attrs.frozen
class ImageSlot:
    """Where one request's tensor of one output field lies in an output segment."""

    field: str
    request_id: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class OutputReady:
    """Rank 0 packed the images of wave ``call_id``.

    ``output`` is the runner output with its tensor fields emptied
    (``RunnerOutput.TENSOR_FIELDS``); their tensors are at ``slots`` in
    shared-memory ``segment``, or, when ``segment`` is None (small outputs), in ``inline``.
    ``retired`` names segments rank 0 has unlinked since its last report, so
    the executor can drop its mappings of them.
    """

    call_id: int
    output: RunnerOutput
    segment: str | None
    inline: bytes
    slots: tuple[ImageSlot, ...]
    retired: tuple[str, ...]


@attrs.frozen
class Fatal:
    """A device fault on ``rank``: the worker group is no longer usable."""

    rank: int
    reason: str


FromWorker = Ready | StartFailed | Reply | ComputeDone | OutputReady | Fatal
