"""The adapter file format: one safetensors file per adapter.

A file holds, for every adapted ``nn.Linear`` named ``LAYER`` (its name in
the pipeline's network, as ``named_modules`` gives it), two float tensors:
``LAYER.lora_A`` of shape ``(rank, in_features)`` and ``LAYER.lora_B`` of shape
``(out_features, rank)``. Its metadata has ``format`` =
:data:`ADAPTER_FORMAT` and may have ``alpha`` (default: the rank). The layer
then computes ``base(x) + scale * (alpha / rank) * B @ (A @ x)``, ``scale``
coming from the request. Layers the file does not name are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ADAPTER_FORMAT = "diffusion-runtime-lora/1"
_SUFFIXES = (".lora_A", ".lora_B")


class AdapterFileError(ValueError):
    """An adapter file is missing, unreadable, or does not fit the network."""


#: A layer's ``(in_features, out_features)``, by layer name.
LayerShapes = Mapping[str, tuple[int, int]]


@attrs.frozen(eq=False)
class LoRAWeights:
    """An adapter in memory: per layer ``(A, B)`` with ``alpha / rank`` folded into ``B``."""

    layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers.values())


def save_adapter(
    path: str | Path,
    layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float | None = None,
) -> None:
    """Write ``layers`` (name → ``(A, B)``) as an adapter file."""
    tensors = {}
    for name, (a, b) in layers.items():
        tensors[name + ".lora_A"] = a.detach().float().contiguous().cpu()
        tensors[name + ".lora_B"] = b.detach().float().contiguous().cpu()
    metadata = {"format": ADAPTER_FORMAT}
    if alpha is not None:
        metadata["alpha"] = repr(float(alpha))
    save_file(tensors, str(path), metadata=metadata)


def check_adapter_file(path: str | Path) -> None:
    """Read only the file's header: raise :class:`AdapterFileError` unless it is an
    adapter file (cheap enough for admission)."""
    _read(path, header_only=True)


def load_adapter(path: str | Path, shapes: LayerShapes, max_rank: int) -> LoRAWeights:
    """Load an adapter file and check it against the network's layer ``shapes``."""
    tensors, alpha = _read(path, header_only=False)
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ranks = set()
    for key in tensors:
        name = key.removesuffix(".lora_A")
        if name == key:
            continue
        a, b = tensors[key], tensors.get(name + ".lora_B")
        if b is None:
            raise AdapterFileError(f"{path}: {key} has no {name}.lora_B")
        if name not in shapes:
            raise AdapterFileError(f"{path}: the network has no adapted layer {name!r}")
        in_features, out_features = shapes[name]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterFileError(
                f"{path}: {name} needs A of shape (rank, {in_features}) and B of shape "
                f"({out_features}, rank); got {tuple(a.shape)} and {tuple(b.shape)}"
            )
        ranks.add(rank)
        layers[name] = (a.float(), b.float())
    strays = [k for k in tensors if k.removesuffix(".lora_B").removesuffix(".lora_A") not in layers]
    if strays or not layers:
        raise AdapterFileError(f"{path}: no adapted layers, or tensors without a pair: {strays}")
    if len(ranks) != 1 or not 1 <= (rank := ranks.pop()) <= max_rank:
        raise AdapterFileError(
            f"{path}: every layer needs one rank in [1, {max_rank}] (EngineConfig.max_lora_rank)"
        )
    factor = rank if alpha is None else alpha
    folded = {name: (a, b * (factor / rank)) for name, (a, b) in layers.items()}
    return LoRAWeights(folded, rank)


def _read(path: str | Path, *, header_only: bool) -> tuple[dict[str, torch.Tensor], float | None]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != ADAPTER_FORMAT:
                raise AdapterFileError(f"{path}: metadata format is not {ADAPTER_FORMAT!r}")
            keys = list(handle.keys())
            if any(not key.endswith(_SUFFIXES) for key in keys):
                raise AdapterFileError(f"{path}: tensor names must end in .lora_A or .lora_B")
            tensors = {} if header_only else {key: handle.get_tensor(key) for key in keys}
            alpha = metadata.get("alpha")
            return tensors, None if alpha is None else float(alpha)
    except AdapterFileError:
        raise
    except Exception as exc:  # a missing file, a bad header, a bad alpha
        raise AdapterFileError(f"{path}: cannot read an adapter file ({exc})") from exc
