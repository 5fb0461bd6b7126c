"""Scheduling policy: which requests run in the next wave or step."""

from diffusion_runtime.contracts import NewRequestData, SchedulerOutput
from diffusion_runtime.fsm import DEADLINE_REASON
from diffusion_runtime.scheduler.base import BaseScheduler, Ended
from diffusion_runtime.scheduler.cost_meter import WaveCostMeter
from diffusion_runtime.scheduler.policies import (
    EarliestDeadlinePolicy,
    FifoPolicy,
    PriorityPolicy,
    SchedulingPolicy,
    SloAwarePolicy,
)
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.scheduler.step_cost import StepCostModel
from diffusion_runtime.scheduler.step_scheduler import StepScheduler

__all__ = [
    "DEADLINE_REASON",
    "BaseScheduler",
    "EarliestDeadlinePolicy",
    "Ended",
    "FifoPolicy",
    "NewRequestData",
    "PriorityPolicy",
    "Request",
    "RequestScheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "SloAwarePolicy",
    "StepCostModel",
    "StepScheduler",
    "WaveCostMeter",
]
