"""LoRA adapters in a diffusers pipeline, loaded by diffusers' own LoRA loading (peft).

Each adapter becomes a peft adapter of the pipeline's UNet, named
``adapter-<id>``, loaded by the pipeline's ``lora_state_dict`` and
``load_lora_into_unet`` exactly as ``pipe.load_lora_weights(path)`` loads it.
Every loaded adapter stays in the UNet on its device: there is no separate
set of device slots (``EngineConfig.max_loras`` still caps the adapters of a
step; the scheduler enforces it). A denoiser call gives every row its own
adapter with peft's mixed-adapter batches: every LoRA layer gets
``adapter_names`` (one per row, ``"__base__"`` for rows without an
adapter) through a forward pre-hook, as peft's own ``PeftModel`` does.

peft keeps one scale per adapter, not per row, so rows asking for one
adapter at different scales run in separate denoiser calls (*passes*); the
common case, one scale per adapter in a batch, is one call. peft is imported
only when adapters are enabled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from safetensors import safe_open
from torch import nn

from diffusion_runtime.errors import InvalidFieldError, PipelineContractError
from diffusion_runtime.lora.weights import AdapterFileError
from diffusion_runtime.lora_request import LoRARequest

#: peft's name for "no adapter" in ``adapter_names``.
BASE = "__base__"
_PREFIX = "unet."
_WEIGHTS = ("lora_A.weight", "lora_B.weight")


def peft_name(adapter_id: int) -> str:
    """The peft adapter name of an adapter id."""
    return f"adapter-{adapter_id}"


@attrs.frozen(eq=False)
class _Adapter:
    """An adapter as diffusers read it, kept in host memory to load it again (level-2 wake)."""

    path: str
    state_dict: dict[str, torch.Tensor]
    network_alphas: Any
    metadata: Any


class PeftAdapters:
    """The :class:`~diffusion_runtime.lora.store.WorkerAdapters` of a diffusers pipeline.

    ``pipe()`` returns the current pipeline object (it changes when the
    weights are loaded again); the pipeline must have diffusers'
    ``lora_state_dict`` and ``load_lora_into_unet`` (``StableDiffusionPipeline``).
    """

    def __init__(self, pipe: Callable[[], Any], max_rank: int) -> None:
        try:  # lazily: the diffusers extra brings peft
            from peft.tuners.lora import LoraLayer
        except ImportError as exc:
            raise PipelineContractError(
                "LoRA adapters for diffusers pipelines need peft: "
                "pip install 'diffusion-runtime[diffusers]'"
            ) from exc

        self._pipe = pipe
        self._layer_type = LoraLayer
        self.max_rank = max_rank
        self._loaded: dict[int, _Adapter] = {}
        self._staged: dict[int, _Adapter] = {}
        self._scales: dict[int, float] = {}
        self._layers: list[Any] = []

    # -- the two-phase contract --------------------------------------------------------

    def check_file(self, path: str) -> None:
        """Read the file's header: every tensor must be a UNet LoRA weight in diffusers'
        peft format (``unet.<module>.lora_A.weight`` / ``.lora_B.weight``) for a
        ``Linear`` or ``Conv2d`` module the UNet has, of rank at most ``max_rank``."""
        try:
            with safe_open(path, framework="pt") as handle:
                shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
        except Exception as exc:  # a missing file, not safetensors
            raise AdapterFileError(f"{path}: cannot read a safetensors file ({exc})") from exc
        if not shapes:
            raise AdapterFileError(f"{path}: holds no tensors")
        unet = self._pipe().unet
        for key, shape in shapes.items():
            self._check_tensor(path, unet, key, shape)

    def stage(self, request: LoRARequest) -> None:
        """Load the adapter into the UNet under its peft name; no request uses it yet."""
        path = request.path
        try:
            self.check_file(path)
            adapter = self._read(path)
        except AdapterFileError as exc:
            raise _refused(path, str(exc)) from exc
        self._inject(request.adapter_id, adapter)
        self._staged[request.adapter_id] = adapter

    def commit(self, adapter_id: int, evict: Iterable[int]) -> None:
        for victim in evict:
            self.remove(victim)
        self._loaded[adapter_id] = self._staged.pop(adapter_id)
        self._scales[adapter_id] = 1.0

    def abort(self, adapter_id: int) -> None:
        if self._staged.pop(adapter_id, None) is not None:
            self._delete(adapter_id)

    def remove(self, adapter_id: int) -> bool:
        if self._loaded.pop(adapter_id, None) is None:
            return False
        self._scales.pop(adapter_id, None)
        self._delete(adapter_id)
        return True

    def loaded_ids(self) -> list[int]:
        return sorted(self._loaded)

    def staged_ids(self) -> list[int]:
        return sorted(self._staged)

    def activate(self, adapter_ids: Iterable[int]) -> None:
        """Every loaded adapter is on the device already; check the step's are loaded."""
        missing = sorted(set(adapter_ids) - self._loaded.keys())
        if missing:
            raise RuntimeError(f"adapters {missing} are not loaded on this worker")

    def reattach(self) -> None:
        """Load every adapter again into a pipeline built anew (after a level-2 wake)."""
        for adapter_id, adapter in sorted(self._loaded.items()):
            self._inject(adapter_id, adapter)
            self._scales[adapter_id] = 1.0

    # -- serving rows ------------------------------------------------------------------

    def passes(
        self, loras: Sequence[LoRARequest | None]
    ) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
        """Split rows (one adapter request per denoiser row) into denoiser calls.

        Yields ``(indices, codes)`` per call: the rows it runs (``None``: all)
        and each one's adapter id (0: none) for :meth:`rows_using`; the scales
        of the call's adapters are set before it is yielded.
        """
        codes = [0 if lora is None else lora.adapter_id for lora in loras]
        scales: dict[int, list[float]] = {}
        for lora in loras:
            if lora is not None and lora.scale not in scales.setdefault(lora.adapter_id, []):
                scales[lora.adapter_id].append(lora.scale)
        count = max((len(values) for values in scales.values()), default=1)
        for number in range(count):
            wanted = {i: values[number] for i, values in scales.items() if number < len(values)}
            for adapter_id, scale in wanted.items():
                self._set_scale(adapter_id, scale)
            if count == 1:
                yield None, torch.tensor(codes)
                return
            rows = [
                row
                for row, lora in enumerate(loras)
                if (lora is None and number == 0)
                or (lora is not None and wanted.get(lora.adapter_id) == lora.scale)
            ]
            yield torch.tensor(rows), torch.tensor([codes[row] for row in rows])

    @contextmanager
    def rows_using(self, codes: torch.Tensor) -> Iterator[None]:
        """During one denoiser call, row ``i`` uses adapter ``codes[i]`` (0: the base model)."""
        names = [BASE if code == 0 else peft_name(code) for code in codes.tolist()]
        hook = functools.partial(_pass_adapter_names, names)
        handles = [
            layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self._layers
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- inside ------------------------------------------------------------------------

    def _check_tensor(self, path: str, unet: nn.Module, key: str, shape: tuple[int, ...]) -> None:
        if "lora_magnitude_vector" in key:
            raise AdapterFileError(
                f"{path}: {key!r} is a DoRA weight; peft cannot mix DoRA adapters in a batch"
            )
        module_name, _, weight = key.removeprefix(_PREFIX).rpartition(".")
        module_name, _, weight_kind = module_name.rpartition(".")
        if not key.startswith(_PREFIX) or f"{weight_kind}.{weight}" not in _WEIGHTS:
            raise AdapterFileError(
                f"{path}: {key!r} is not a UNet LoRA weight in diffusers' peft format "
                "('unet.<module>.lora_A.weight' or '.lora_B.weight', as save_lora_weights "
                "writes it; text encoder adapters are not served)"
            )
        try:
            module = unet.get_submodule(module_name)
        except AttributeError:
            raise AdapterFileError(
                f"{path}: the UNet has no module {module_name!r} "
                "(the adapter targets another model)"
            ) from None
        base = getattr(module, "base_layer", module)
        if not isinstance(base, (nn.Linear, nn.Conv2d)):
            raise AdapterFileError(
                f"{path}: {module_name!r} is a {type(base).__name__}; adapters are served on "
                "Linear and Conv2d modules (those peft mixes in one batch)"
            )
        if weight_kind == "lora_A":
            fan_in = base.in_features if isinstance(base, nn.Linear) else base.in_channels
            rank = shape[0]
            if not 1 <= rank <= self.max_rank or len(shape) < 2 or shape[1] != fan_in:
                raise AdapterFileError(
                    f"{path}: {key} has shape {shape}; it needs (rank, {fan_in}, ...) with rank "
                    f"in [1, {self.max_rank}] (EngineConfig.max_lora_rank)"
                )

    def _read(self, path: str) -> _Adapter:
        pipe = self._pipe()
        try:
            state_dict, alphas, metadata = pipe.lora_state_dict(
                path, return_lora_metadata=True, local_files_only=True
            )
        except Exception as exc:
            raise AdapterFileError(f"{path}: diffusers cannot read it ({exc})") from exc
        return _Adapter(path, dict(state_dict), alphas, metadata)

    def _inject(self, adapter_id: int, adapter: _Adapter) -> None:
        pipe = self._pipe()
        try:
            pipe.load_lora_into_unet(
                dict(adapter.state_dict),
                network_alphas=adapter.network_alphas,
                unet=pipe.unet,
                adapter_name=peft_name(adapter_id),
                metadata=adapter.metadata,
            )
        except Exception as exc:
            self._delete(adapter_id)
            reason = f"{adapter.path}: diffusers cannot load it into the UNet ({exc})"
            raise _refused(adapter.path, reason) from exc
        self._refresh_layers()

    def _delete(self, adapter_id: int) -> None:
        unet = self._pipe().unet
        name = peft_name(adapter_id)
        if name in getattr(unet, "peft_config", {}):
            unet.delete_adapters([name])
        self._refresh_layers()

    def _refresh_layers(self) -> None:
        unet = self._pipe().unet
        self._layers = [module for module in unet.modules() if isinstance(module, self._layer_type)]

    def _set_scale(self, adapter_id: int, scale: float) -> None:
        """Set an adapter's scale as diffusers' ``set_adapters(name, scale)`` sets it."""
        if self._scales.get(adapter_id) == scale:
            return
        name = peft_name(adapter_id)
        for layer in self._layers:
            layer.set_scale(name, scale)
        self._scales[adapter_id] = scale


def _pass_adapter_names(
    names: list[str], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, {**kwargs, "adapter_names": names}


def _refused(path: str, reason: str) -> InvalidFieldError:
    return InvalidFieldError(
        "LoRARequest",
        "path",
        f"names an adapter the diffusers pipeline cannot load: {reason}",
        path,
    )
