"""The weights a pipeline holds: which modules, which tensors, and how many bytes.

A pipeline names its weight modules with an optional ``weight_modules()``
returning ``{name: torch.nn.Module}``; without it, every ``torch.nn.Module``
reachable from the pipeline's attributes (through plain objects, attrs
instances, dicts, lists and tuples) counts, named by its attribute path. A
module's submodules belong to it; a module reached twice counts once.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

#: Values never walked into: scalars, tensors outside modules, generators, code.
_LEAVES = (
    str,
    bytes,
    int,
    float,
    bool,
    type(None),
    torch.Tensor,
    torch.Generator,
    type,
    types.FunctionType,
    types.MethodType,
    types.ModuleType,
)


@attrs.frozen
class TensorSpec:
    """What a weight tensor must be after a wake: its shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)


@attrs.frozen
class WeightSlot:
    """Where one weight tensor lives: ``owner.<attribute>`` is a parameter or a buffer."""

    name: str
    owner: torch.nn.Module
    attribute: str
    is_parameter: bool

    def get(self) -> torch.Tensor:
        tensor: torch.Tensor = getattr(self.owner, self.attribute)
        return tensor

    def put(self, tensor: torch.Tensor) -> None:
        """Replace the tensor's contents; a parameter keeps its identity (so
        ``tensor`` must have a device type it can hold: not ``meta``)."""
        if self.is_parameter:
            self.get().data = tensor
        else:
            setattr(self.owner, self.attribute, tensor)

    def replace(self, tensor: torch.Tensor) -> None:
        """Install ``tensor`` in place of the old one (a new parameter for a parameter)."""
        if self.is_parameter:
            old = self.get()
            tensor = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
        setattr(self.owner, self.attribute, tensor)


def weight_modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's weight modules by name (see the module docstring)."""
    named = getattr(pipeline, "weight_modules", None)
    if callable(named):
        return dict(named())
    found: dict[str, torch.nn.Module] = {}
    _collect(pipeline, "", found, set())
    return found


def weight_slots(modules: Mapping[str, torch.nn.Module]) -> list[WeightSlot]:
    """Every parameter and buffer of ``modules``, in a stable order. A tensor
    shared by two owners has a slot in each."""
    return [slot for prefix, module in modules.items() for slot in _module_slots(prefix, module)]


def device_weight_bytes(pipeline: Any, device: torch.device) -> int:
    """Bytes of weight storage the pipeline holds on ``device`` (each storage once;
    ``cuda`` without an index counts every CUDA device)."""
    storages: dict[int, int] = {}
    for slot in weight_slots(weight_modules(pipeline)):
        tensor = slot.get()
        on_device = tensor.device.type == device.type and device.index in (
            None,
            tensor.device.index,
        )
        if on_device:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _module_slots(prefix: str, module: torch.nn.Module) -> Iterator[WeightSlot]:
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        base = ".".join(part for part in (prefix, owner_name) if part)
        for name, param in owner.named_parameters(recurse=False):
            if param is not None:
                yield WeightSlot(f"{base}.{name}", owner, name, True)
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None:
                yield WeightSlot(f"{base}.{name}", owner, name, False)


def _collect(value: Any, path: str, found: dict[str, torch.nn.Module], seen: set[int]) -> None:
    if isinstance(value, _LEAVES) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.nn.Module):
        found[path or "pipeline"] = value
        return
    if isinstance(value, dict):
        items: Iterator[tuple[str, Any]] = ((str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    elif attrs.has(type(value)):
        items = ((f.name, getattr(value, f.name)) for f in attrs.fields(type(value)))
    elif hasattr(value, "__dict__"):
        items = iter(list(vars(value).items()))
    else:
        return
    for key, item in items:
        _collect(item, f"{path}.{key}" if path else key, found, seen)
