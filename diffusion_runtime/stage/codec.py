"""Runtime objects to messages and back: sampling params, outputs with their images, errors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import msgspec
import torch
import zmq

from diffusion_runtime import errors
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import RequestMetrics, RequestOutput, Trajectory
from diffusion_runtime.sampling_params import SamplingParams
from diffusion_runtime.stage.endpoints import DEFAULT_MAX_REPLY_BYTES
from diffusion_runtime.stage.errors import StageProtocolError
from diffusion_runtime.stage.messages import (
    Error,
    FieldErrorMsg,
    LoRARequestMsg,
    MetricsMsg,
    Result,
    SamplingParamsMsg,
    TensorMeta,
    TrajectoryMsg,
)

#: The tensor dtypes that may cross, by the name :class:`TensorMeta` uses.
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}

#: The largest size of one tensor dimension (torch sizes are signed 64-bit).
MAX_DIM = 2**63 - 1

# -- sampling params -------------------------------------------------------------------


def lora_to_msg(lora: LoRARequest) -> LoRARequestMsg:
    return LoRARequestMsg(**attrs.asdict(lora))


def params_to_msg(params: SamplingParams) -> SamplingParamsMsg:
    fields = attrs.asdict(params, recurse=False)
    fields["lora"] = None if params.lora is None else lora_to_msg(params.lora)
    return SamplingParamsMsg(**fields)


def params_from_msg(msg: SamplingParamsMsg) -> SamplingParams:
    """Build (and so validate) the params: ``InvalidFieldError`` names a bad field."""
    fields = msgspec.structs.asdict(msg)
    lora = msg.lora
    fields["lora"] = None if lora is None else LoRARequest(**msgspec.structs.asdict(lora))
    return SamplingParams(**fields)


# -- outputs and their images ----------------------------------------------------------


def tensor_to_frame(tensor: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    """The tensor's layout and a zero-copy view of its bytes (copied only if not
    contiguous on the CPU)."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"a {tensor.dtype} tensor cannot cross to the client")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return TensorMeta(name, list(tensor.shape)), flat.view(torch.uint8).numpy().data


def tensor_from_frame(meta: TensorMeta, frame: zmq.Frame) -> torch.Tensor:
    """A tensor over the frame's own memory (no copy); the frame lives as long as it.

    Any layout the frame cannot hold (an unknown dtype, a negative or
    overflowing size, a byte count that does not match) is a
    :class:`StageProtocolError`.
    """
    dtype = DTYPES.get(meta.dtype)
    if dtype is None:
        raise StageProtocolError(f"unknown tensor dtype {meta.dtype!r}")
    if any(not 0 <= size <= MAX_DIM for size in meta.shape):
        raise StageProtocolError(f"a tensor shape's sizes must be in [0, 2**63); got {meta.shape}")
    expected = math.prod(meta.shape) * dtype.itemsize
    buffer = frame.buffer
    if buffer.nbytes != expected:
        raise StageProtocolError(
            f"a {meta.dtype} tensor of shape {meta.shape} needs {expected} bytes; "
            f"the frame holds {buffer.nbytes}"
        )
    try:
        if expected == 0:
            return torch.empty(meta.shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).view(meta.shape)
    except (RuntimeError, ValueError, TypeError) as exc:  # torch's own limits on shapes
        raise StageProtocolError(f"a tensor of shape {meta.shape} cannot be built: {exc}") from None


def output_to_frames(
    output: RequestOutput, max_image_bytes: int = DEFAULT_MAX_REPLY_BYTES
) -> tuple[Result, list[memoryview]]:
    """The :class:`Result` message for ``output`` and the frames of its tensors
    (images, latents, trajectory), in the order :class:`Result` gives.

    Tensors over ``max_image_bytes`` in all (the client's frame limit) cannot
    cross: a preview goes without them, and a completed output becomes an
    error saying so.
    """
    tensors = _output_tensors(output)
    status, error = output.status, output.error
    total = sum(tensor.nbytes for tensor in tensors.values() if tensor is not None)
    if total > max_image_bytes:
        tensors = dict.fromkeys(tensors)
        if status is RequestStatus.FINISHED_COMPLETED:
            status = RequestStatus.FINISHED_ERROR
            error = (
                f"the output's tensors ({total} bytes) are over the "
                f"client's max_reply_bytes ({max_image_bytes})"
            )
    metas: dict[str, TensorMeta | None] = {}
    payloads: list[memoryview] = []
    for name, tensor in tensors.items():
        metas[name] = None
        if tensor is not None:
            metas[name], payload = tensor_to_frame(tensor)
            payloads.append(payload)
    trajectory = output.trajectory
    trajectory_msg = None
    if trajectory is not None and metas["trajectory_latents"] is not None:
        trajectory_msg = TrajectoryMsg(
            latents=metas["trajectory_latents"],
            log_probs=metas["trajectory_log_probs"],
            timesteps=list(trajectory.timesteps),
            log_prob_steps=list(trajectory.log_prob_steps),
            first_step=trajectory.first_step,
        )
    metrics = None if output.metrics is None else MetricsMsg(**attrs.asdict(output.metrics))
    result = Result(
        request_id=output.request_id,
        status=status,
        finished=output.finished,
        seed=output.seed,
        error=error,
        metrics=metrics,
        step=output.step,
        num_steps=output.num_steps,
        image=metas["image"],
        latents=metas["latents"],
        trajectory=trajectory_msg,
    )
    return result, payloads


def _output_tensors(output: RequestOutput) -> dict[str, torch.Tensor | None]:
    """The tensors an output carries, by name, in frame order."""
    trajectory = output.trajectory
    return {
        "image": output.image_batch,
        "latents": output.latents,
        "trajectory_latents": None if trajectory is None else trajectory.latents,
        "trajectory_log_probs": None if trajectory is None else trajectory.log_probs,
    }


def output_from_frames(result: Result, extra: Sequence[zmq.Frame]) -> RequestOutput:
    """Rebuild the output of ``result``; ``extra`` are the frames after its header."""
    trajectory = result.trajectory
    metas = [
        result.image,
        result.latents,
        None if trajectory is None else trajectory.latents,
        None if trajectory is None else trajectory.log_probs,
    ]
    if len(extra) != sum(meta is not None for meta in metas):
        described = sum(meta is not None for meta in metas)
        raise StageProtocolError(
            f"a Result that describes {described} tensors came with {len(extra)} extra frames"
        )
    frames = iter(extra)
    images, latents, trajectory_latents, log_probs = (
        None if meta is None else tensor_from_frame(meta, next(frames)) for meta in metas
    )
    metrics = (
        None if result.metrics is None else RequestMetrics(**msgspec.structs.asdict(result.metrics))
    )
    return RequestOutput(
        request_id=result.request_id,
        status=result.status,
        finished=result.finished,
        image_batch=images,
        seed=result.seed,
        error=result.error,
        metrics=metrics,
        step=result.step,
        num_steps=result.num_steps,
        latents=latents,
        trajectory=None
        if trajectory is None or trajectory_latents is None
        else Trajectory(
            latents=trajectory_latents,
            timesteps=tuple(trajectory.timesteps),
            log_probs=log_probs,
            log_prob_steps=tuple(trajectory.log_prob_steps),
            first_step=trajectory.first_step,
        ),
    )


# -- errors ----------------------------------------------------------------------------

#: Exceptions rebuilt with their own class on the client; any other becomes a
#: :class:`~diffusion_runtime.DiffusionRuntimeError` that names the remote class.
_REBUILT: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        errors.DuplicateRequestError,
        errors.QueueFullError,
        errors.EngineClosedError,
        errors.EngineDeadError,
        errors.RPCError,
        errors.PipelineContractError,
        errors.LoRAError,
        errors.SleepStateError,
        errors.ProfilingError,
        ValueError,
        TypeError,
        KeyError,
        TimeoutError,
    )
}
PROTOCOL_ERROR = "ProtocolError"


def error_to_msg(
    exc: BaseException, request_id: str | None = None, call_id: int | None = None
) -> Error:
    """The :class:`Error` reply for ``exc``, tied to a request or a call."""
    field_error = None
    if isinstance(exc, errors.InvalidFieldError):
        value = exc.value
        if not isinstance(value, (str, int, float, bool, type(None))):
            value = repr(value)
        field_error = FieldErrorMsg(exc.owner, exc.field, exc.rule, value)
    kind = PROTOCOL_ERROR if isinstance(exc, StageProtocolError) else type(exc).__name__
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return Error(kind, str(message), request_id, call_id, field_error)


def error_from_msg(msg: Error) -> Exception:
    """The exception an :class:`Error` reply stands for, to raise on the client."""
    if msg.field_error is not None:
        f = msg.field_error
        return errors.InvalidFieldError(f.owner, f.field, f.rule, f.value)
    if msg.kind == PROTOCOL_ERROR:
        return StageProtocolError(msg.message)
    cls = _REBUILT.get(msg.kind)
    if cls is None:
        return errors.DiffusionRuntimeError(f"{msg.kind}: {msg.message}")
    return cls(msg.message)
