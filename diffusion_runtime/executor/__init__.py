"""Execution backends: how scheduler outputs reach the workers."""

from diffusion_runtime.executor.base import DiffusionExecutor
from diffusion_runtime.executor.selection import resolve_executor_class
from diffusion_runtime.executor.uni import UniProcExecutor

__all__ = ["DiffusionExecutor", "UniProcExecutor", "resolve_executor_class"]
