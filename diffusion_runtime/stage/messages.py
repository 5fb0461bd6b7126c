"""What crosses the stage's sockets: msgspec structs, encoded as msgpack, never pickled.

Each direction has one tagged union (the tag is the class name, in field
``type``), so one decoder reads every message of that direction and rejects
unknown tags and unknown fields. A message is one msgpack frame; a
:class:`Result` that carries images is followed by one more frame holding the
tensor's raw bytes, laid out as its :class:`TensorMeta` says.

Client → stage (:data:`ToStage`): :class:`AddRequest`, :class:`AddRequests`,
:class:`Abort`, :class:`Pause`, :class:`Resume`, :class:`CollectiveRPC`,
:class:`StatusQuery`, :class:`Sleep`, :class:`WakeUp`, :class:`Profile`,
:class:`Shutdown`.
Stage → client (:data:`FromStage`): :class:`Ready` or :class:`StartFailed` once,
then :class:`Admitted`, :class:`Result`, :class:`Error`, :class:`RPCResult`,
:class:`Status`, and :class:`StageDead` last if the core dies.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.sampling_params import MAX_SEED


class _Message(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Base of every message: tagged by class name, strict about fields."""


class _Part(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the untagged structs nested in messages."""


#: A seed the client chose: in the range ``SamplingParams.seed`` allows.
Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)]


# -- nested parts ----------------------------------------------------------------------


class LoRARequestMsg(_Part, frozen=True):
    """The fields of :class:`~diffusion_runtime.LoRARequest`."""

    name: str
    adapter_id: int
    path: str
    scale: float = 1.0


class SamplingParamsMsg(_Part, frozen=True):
    """The fields of :class:`~diffusion_runtime.SamplingParams`; the stage
    validates them again by building one."""

    num_inference_steps: int
    guidance_scale: float
    seed: int | None
    num_outputs_per_prompt: int
    height: int | None
    width: int | None
    extra_args: dict[str, Any]
    priority: int = 0
    deadline_s: float | None = None
    lora: LoRARequestMsg | None = None
    output_type: str = "pil"
    return_trajectory: bool | str = False
    stream_trajectory: bool = False
    timesteps: tuple[int | float, ...] | None = None
    sigmas: tuple[float, ...] | None = None
    cache: bool | dict[str, Any] | None = None


class MetricsMsg(_Part, frozen=True):
    queue_time_s: float
    execution_time_s: float
    total_time_s: float
    stage_durations: dict[str, float] = {}
    peak_memory_mb: float | None = None
    cached_steps: int = 0
    model_evaluations: int = 0


class TensorMeta(_Part, frozen=True):
    """The layout of the raw tensor bytes in the frame after the header: C order."""

    dtype: str
    shape: list[int]


class TrajectoryMsg(_Part, frozen=True):
    """A :class:`~diffusion_runtime.outputs.Trajectory`, or a streamed part of one:
    its tensors' layouts (their frames follow the image's, latents first) and its
    step numbers."""

    latents: TensorMeta
    log_probs: TensorMeta | None
    timesteps: list[int]
    log_prob_steps: list[int]
    first_step: Annotated[int, msgspec.Meta(ge=0)] = 0


class FieldErrorMsg(_Part, frozen=True):
    """An :class:`~diffusion_runtime.InvalidFieldError`'s parts; ``value`` is the
    value itself when msgpack can carry it, else its ``repr``."""

    owner: str
    field: str
    rule: str
    value: Any


# -- client → stage --------------------------------------------------------------------


class AddRequest(_Message, frozen=True):
    """One request; the client chose its id and its ``seed``."""

    request_id: str
    prompt: Any
    params: SamplingParamsMsg
    seed: Seed


class AddRequests(_Message, frozen=True):
    """Several requests with one ``params``, admitted all or none: request
    ``child_ids[i]`` runs ``prompts[i]`` with ``seeds[i]`` (a batch request's
    prompts, or a ``generate`` call's). :class:`Admitted` or :class:`Error`
    names ``request_id`` (the batch's id, or the first request's); each
    request's outputs come under its own id."""

    request_id: str
    child_ids: list[str]
    prompts: list[Any]
    params: SamplingParamsMsg
    seeds: list[Seed]


class Abort(_Message, frozen=True):
    request_ids: list[str]
    reason: str


class Pause(_Message, frozen=True):
    """The core starts no wave until :class:`Resume`; what arrives meanwhile queues."""


class Resume(_Message, frozen=True):
    """End a pause: the core's next step takes everything sent before this."""


class CollectiveRPC(_Message, frozen=True):
    call_id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    timeout: float | None
    unique_reply_rank: int | None


class StatusQuery(_Message, frozen=True):
    call_id: int


class Sleep(_Message, frozen=True):
    """``EngineCore.sleep(level)`` between two steps; answered by an :class:`RPCResult`."""

    call_id: int
    level: int


class WakeUp(_Message, frozen=True):
    """``EngineCore.wake_up()``; answered by an :class:`RPCResult`."""

    call_id: int


class Profile(_Message, frozen=True):
    """``start_profile(prefix)`` or ``stop_profile()`` on the core; the reply's value
    is the trace paths, by rank."""

    call_id: int
    is_start: bool
    prefix: str | None = None


class Shutdown(_Message, frozen=True):
    pass


ToStage = (
    AddRequest
    | AddRequests
    | Abort
    | Pause
    | Resume
    | CollectiveRPC
    | StatusQuery
    | Sleep
    | WakeUp
    | Profile
    | Shutdown
)


# -- stage → client --------------------------------------------------------------------


class Ready(_Message, frozen=True):
    """The core is built and warmed up; requests go to ``request_endpoint``."""

    pid: int
    request_endpoint: str
    rpc_methods: list[str]


class StartFailed(_Message, frozen=True):
    """The core could not be built; the process exits right after."""

    error: str
    traceback: str


class Admitted(_Message, frozen=True):
    """The core admitted the request (or every child of the batch) named ``request_id``."""

    request_id: str


class Result(_Message, frozen=True):
    """One :class:`~diffusion_runtime.RequestOutput`. Each tensor it describes comes in
    a frame of its own after the header, in this order: ``image``, ``latents``,
    the trajectory's latents, the trajectory's log-probabilities (those present)."""

    request_id: str
    status: RequestStatus
    finished: bool
    seed: int
    error: str | None
    metrics: MetricsMsg | None
    step: int | None
    num_steps: int | None
    image: TensorMeta | None
    latents: TensorMeta | None = None
    trajectory: TrajectoryMsg | None = None


class Error(_Message, frozen=True):
    """A refused message, tied to the request or call it names.

    ``kind`` is the exception's class name (``ProtocolError`` for a message
    the stage could not read).
    """

    kind: str
    message: str
    request_id: str | None = None
    call_id: int | None = None
    field_error: FieldErrorMsg | None = None


class RPCResult(_Message, frozen=True):
    call_id: int
    value: Any


class Status(_Message, frozen=True):
    call_id: int
    healthy: bool
    error: str | None
    queue_length: int


class StageDead(_Message, frozen=True):
    """The sentinel: the core is dead, the stage exits; every pending call fails."""

    reason: str


FromStage = Ready | StartFailed | Admitted | Result | Error | RPCResult | Status | StageDead


# -- encoding --------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_to_stage = msgspec.msgpack.Decoder(ToStage)
_from_stage = msgspec.msgpack.Decoder(FromStage)


def encode(message: _Message) -> bytes:
    """msgpack bytes of ``message``; ``TypeError`` if a field holds what msgpack cannot."""
    return _encoder.encode(message)


def decode_to_stage(data: bytes | memoryview) -> ToStage:
    """Decode a client message; ``msgspec.DecodeError`` if it is not one."""
    return _to_stage.decode(data)


def decode_from_stage(data: bytes | memoryview) -> FromStage:
    """Decode a stage message; ``msgspec.DecodeError`` if it is not one."""
    return _from_stage.decode(data)


def salvage_ids(data: bytes | memoryview) -> tuple[str | None, int | None]:
    """The ``request_id`` and ``call_id`` of a message that failed to decode, if readable."""
    try:
        loose = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None, None
    if not isinstance(loose, dict):
        return None, None
    request_id = loose.get("request_id")
    call_id = loose.get("call_id")
    return (
        request_id if isinstance(request_id, str) else None,
        call_id if isinstance(call_id, int) and not isinstance(call_id, bool) else None,
    )
