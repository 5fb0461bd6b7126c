"""Build the adapter from a local directory written by diffusers' ``save_pretrained``."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.pipelines.diffusers.adapter import DiffusersPipeline
from diffusion_runtime.pipelines.diffusers.support import check_class_name

_OWNER = "diffusers"


def from_pretrained_dir(
    device: torch.device | str,
    path: str,
    torch_dtype: str | None = None,
    rows_per_call: int | None = None,
) -> DiffusersPipeline:
    """Load the pipeline saved in ``path`` (local files only, never the hub) and wrap it.

    The engine calls this for ``EngineConfig(pipeline="diffusers",
    pipeline_kwargs={"path": ...})``. ``torch_dtype`` names a torch dtype
    (``"float16"``); the class saved in ``model_index.json`` is checked
    before any weight is read. The adapter reloads from ``path`` after a
    level-2 sleep.
    """
    root = Path(path)
    index = root / "model_index.json"
    if not index.is_file():
        rule = "must be a local directory written by save_pretrained (with model_index.json)"
        raise InvalidFieldError(_OWNER, "path", rule, path)
    check_class_name(json.loads(index.read_text()).get("_class_name"))
    dtype = None
    if torch_dtype is not None:
        dtype = getattr(torch, torch_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidFieldError(_OWNER, "torch_dtype", "must name a torch dtype", torch_dtype)
    diffusers = importlib.import_module("diffusers")  # lazily: it takes seconds to import

    def load() -> Any:
        return diffusers.DiffusionPipeline.from_pretrained(
            root, local_files_only=True, torch_dtype=dtype
        )

    # The source reloads the same files after a level-2 sleep.
    return DiffusersPipeline(load(), device, rows_per_call=rows_per_call, source=load)
