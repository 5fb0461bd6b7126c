"""Scheduling policy: which requests run in the next wave or step."""

from diffusion_runtime.contracts import NewRequestData, SchedulerOutput
from diffusion_runtime.scheduler.base import BaseScheduler
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler

__all__ = ["BaseScheduler", "NewRequestData", "Request", "RequestScheduler", "SchedulerOutput"]
