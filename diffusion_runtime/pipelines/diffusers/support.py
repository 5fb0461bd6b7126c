"""Which diffusers pipelines the adapter runs, and why it refuses the others."""

from __future__ import annotations

from typing import Any

from diffusion_runtime.errors import DiffusionRuntimeError
from diffusion_runtime.pipelines.diffusers.dit import DiTFamily
from diffusion_runtime.pipelines.diffusers.family import Family
from diffusion_runtime.pipelines.diffusers.stable_diffusion import StableDiffusionFamily
from diffusion_runtime.pipelines.diffusers.unconditional import UnconditionalFamily

_FAMILIES: dict[str, type[Family]] = {
    name: family
    for family in (UnconditionalFamily, DiTFamily, StableDiffusionFamily)
    for name in family.pipeline_classes
}

#: The diffusers pipeline classes the adapter runs (exact classes, not subclasses).
SUPPORTED_PIPELINES: tuple[str, ...] = tuple(sorted(_FAMILIES))

_WHY_OTHERS = (
    "The adapter re-implements each pipeline's denoising loop step by step and is tested "
    "equal to diffusers' own output only for these; other pipelines (and subclasses, which "
    "may override __call__) carry inputs or state across steps that a step-wise split would "
    "silently drop or reorder: image latents and masks, control images, added time ids, "
    "guidance embeddings, refiner hand-offs."
)


class UnsupportedPipelineError(DiffusionRuntimeError, TypeError):
    """The object is not a diffusers pipeline the adapter can run faithfully."""


def family_for(pipe: Any) -> type[Family]:
    """The family that runs ``pipe``; raises :class:`UnsupportedPipelineError` otherwise."""
    cls = type(pipe)
    name = cls.__name__
    family = _FAMILIES.get(name) if cls.__module__.startswith("diffusers.") else None
    if family is None:
        raise UnsupportedPipelineError(
            f"{cls.__module__}.{cls.__qualname__} is not supported. "
            f"Supported: {', '.join(SUPPORTED_PIPELINES)}. {_WHY_OTHERS}"
        )
    reason = family.refusal(pipe)
    if reason is not None:
        raise UnsupportedPipelineError(f"this {name} is not supported: {reason}")
    return family


def check_class_name(name: object) -> None:
    """Refuse a pipeline by its saved ``_class_name`` before any weight is loaded."""
    if name not in _FAMILIES:
        raise UnsupportedPipelineError(
            f"{name!r} is not supported. Supported: {', '.join(SUPPORTED_PIPELINES)}. {_WHY_OTHERS}"
        )
