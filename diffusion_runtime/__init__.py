"""diffusion-runtime: a serving runtime for diffusion-model inference.

Every request is an explicit state machine; see :mod:`diffusion_runtime.fsm`.
"""

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine, EngineSnapshot, EngineState
from diffusion_runtime.errors import (
    DeviceFault,
    DiffusionRuntimeError,
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidFieldError,
    PipelineContractError,
    ProfilingError,
    QueueFullError,
    RPCError,
    SleepStateError,
)
from diffusion_runtime.executor import DiffusionExecutor
from diffusion_runtime.fsm import LifecycleEvent, LifecycleViolation, RequestStatus
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.outputs import RequestMetrics, RequestOutput
from diffusion_runtime.pipelines.registry import register_pipeline
from diffusion_runtime.sampling_params import SamplingParams

__all__ = [
    "DeviceFault",
    "DiffusionEngine",
    "DiffusionExecutor",
    "DiffusionRuntimeError",
    "DuplicateRequestError",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineSnapshot",
    "EngineState",
    "InvalidFieldError",
    "LifecycleEvent",
    "LifecycleViolation",
    "LoRARequest",
    "PipelineContractError",
    "ProfilingError",
    "QueueFullError",
    "RPCError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SleepStateError",
    "register_pipeline",
]
