"""Run diffusers pipelines in the runtime's request and step modes.

Importing this package never imports diffusers or transformers: the adapter
only touches the pipeline object it is given, and :func:`from_pretrained_dir`
imports diffusers when it is called.
"""

from diffusion_runtime.pipelines.diffusers.adapter import DiffusersPipeline
from diffusion_runtime.pipelines.diffusers.loading import from_pretrained_dir
from diffusion_runtime.pipelines.diffusers.support import (
    SUPPORTED_PIPELINES,
    UnsupportedPipelineError,
)

__all__ = [
    "SUPPORTED_PIPELINES",
    "DiffusersPipeline",
    "UnsupportedPipelineError",
    "from_pretrained_dir",
]
