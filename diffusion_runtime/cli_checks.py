"""Checks the command line makes before it builds an engine or writes a file.

Each failed check raises :class:`CommandError`, which the command line prints
as one ``error: ...`` line, so a bad option costs no generation and shows no
traceback.
"""

from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path
from typing import Any

from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.pipelines.registry import resolve_pipeline_factory


class CommandError(Exception):
    """A command-line input that cannot work; the message says which and why."""


def parse_pipeline_args(pairs: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs as factory keyword arguments; a value that reads as
    JSON (``4``, ``true``, ``null``) is taken as that, anything else as a string."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.isidentifier():
            raise CommandError(f"--pipeline-arg {pair!r} must have the form NAME=VALUE")
        try:
            kwargs[name] = json.loads(text)
        except ValueError:
            kwargs[name] = text
    return kwargs


def check_pipeline(spec: str, kwargs: dict[str, Any]) -> None:
    """``spec`` imports and can be called as ``factory(device=..., **kwargs)``."""
    try:
        factory = resolve_pipeline_factory(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        raise CommandError(f"--pipeline {spec!r} does not import: {exc}") from None
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some built-ins have no signature: let the engine try
        return
    try:
        signature.bind(device="cpu", **kwargs)
    except TypeError as exc:
        needed = [
            name
            for name, parameter in signature.parameters.items()
            if parameter.default is parameter.empty
            and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            and name != "device"
            and name not in kwargs
        ]
        hint = "".join(f" --pipeline-arg {name}=VALUE" for name in needed)
        raise CommandError(
            f"--pipeline {spec!r} cannot be called as factory(device=...): {exc}"
            + (f"; pass{hint}" if hint else "")
        ) from None


def prepare_output_dir(path: Path) -> None:
    """Create ``path`` if needed and make sure files can be written there."""
    if path.exists() and not path.is_dir():
        raise CommandError(f"--out {str(path)!r} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise CommandError(f"--out {str(path)!r} is not writable: {exc.strerror}") from None


def shipped_lora(name: str, pipeline: str) -> LoRARequest:
    """The request for the digits model's shipped adapter ``name`` (``generate --lora``)."""
    from diffusion_runtime.pipelines.digits import LORA_ADAPTERS

    if pipeline != "digits":
        raise CommandError(
            f"--lora needs --pipeline digits (the adapters ship with it); got {pipeline!r}"
        )
    if name not in LORA_ADAPTERS:
        known = ", ".join(sorted(LORA_ADAPTERS))
        raise CommandError(f"--lora {name!r} is not a shipped adapter; known: {known}")
    return LoRARequest(name=name, adapter_id=1, path=str(LORA_ADAPTERS[name]))
