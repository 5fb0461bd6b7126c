"""Scheduling policy: which requests run in the next wave or step."""

from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.scheduler.output import NewRequestData, SchedulerOutput
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.scheduler.step_scheduler import StepScheduler

__all__ = [
    "BaseScheduler",
    "NewRequestData",
    "Request",
    "RequestScheduler",
    "SchedulerOutput",
    "StepScheduler",
]
