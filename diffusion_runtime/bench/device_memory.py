"""What a process holds on its CUDA device, read so that only live tensors count."""

from __future__ import annotations

import gc

import torch


def device_memory_in_use() -> tuple[int, int]:
    """``(bytes allocated by this process's tensors, bytes in use on the device)``,
    after a garbage collection, with torch's caches emptied."""
    gc.collect()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per thread and stream, allocated like a tensor.
    clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_cublas_workspaces is not None:
        clear_cublas_workspaces()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return torch.cuda.memory_allocated(), total - free
