"""Keeps the step states of idle requests in host memory, within a byte budget.

A state is idle when a step does not run it: its request is preempted (or
otherwise left out of the step). The offloader moves an idle state's tensors
to host memory, pinned when the device is CUDA, and moves them back to the
device before the step that runs the state again. The values are copied
exactly, so a resumed request's output is unchanged.

What moves: every device tensor reachable from the state's ``latents``,
``timesteps``, ``scheduler``, ``conditioning``, trajectory ``recorder`` and
``step_cache`` through lists, tuples, dicts, attrs instances and plain
objects' attributes (a tensor reached twice is copied once, so aliases stay
aliases). Modules (shared weights) and the
request's generator stay where they are: a CUDA generator holds only a seed
and an offset, no device memory, and cannot live on the host.

Order: the state idle the longest goes first; a state that does not fit in
what is left of the budget is skipped for the next one (an idle state does
not change, so it is measured once per idle spell). A state counts
``numel * element_size`` bytes per tensor moved. On a CPU device the tensors
already live in host memory: ``tensor.to("cpu")`` returns the same tensor,
so nothing is copied, but the accounting is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from diffusion_runtime.pipelines.protocols import StepRequestState

TensorMap = Callable[[torch.Tensor], torch.Tensor]

_SCALAR_TYPES = (str, bytes, int, float, bool, type(None))

#: Values never walked into, besides callables (modules, functions, classes: shared
#: weights and code): scalars and generators.
_OPAQUE = (*_SCALAR_TYPES, torch.Generator)

#: The fields of a state that hold its tensors (``request`` holds the generator).
_TENSOR_FIELDS = ("latents", "timesteps", "scheduler", "conditioning", "recorder", "step_cache")


@attrs.define
class _Offloaded:
    """One offloaded state: its size and its host copies (to be moved back)."""

    num_bytes: int
    host_copies: list[torch.Tensor]


class StateOffloader:
    """Moves idle step states between one device and host memory, within ``budget_bytes``."""

    def __init__(self, device: torch.device, budget_bytes: int) -> None:
        self.device = device
        self.budget_bytes = budget_bytes
        self._pin = device.type == "cuda"
        # Request ids by when they last ran, least recently first.
        self._last_ran: dict[str, None] = {}
        self._offloaded: dict[str, _Offloaded] = {}
        # Device bytes of idle states, measured once per idle spell.
        self._idle_bytes: dict[str, int] = {}
        #: How many states have come back from host memory so far.
        self.restores = 0

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the states now in host memory."""
        return sum(entry.num_bytes for entry in self._offloaded.values())

    def offloaded_ids(self) -> list[str]:
        """Ids of the states now in host memory."""
        return list(self._offloaded)

    def place(self, states: Mapping[str, StepRequestState], running: Sequence[str]) -> bool:
        """Before a step that runs ``running``: bring their states back to the device,
        then offload idle states while the budget allows. True when a state moved
        (it now holds new tensors)."""
        moved = False
        running_ids = set(running)
        for request_id in running:
            self._last_ran.pop(request_id, None)
            self._last_ran[request_id] = None
            self._idle_bytes.pop(request_id, None)
            entry = self._offloaded.pop(request_id, None)
            if entry is not None:
                self._restore(states[request_id], entry)
                self.restores += 1
                moved = True
        room = self.budget_bytes - self.offloaded_bytes
        for request_id in self._last_ran:
            state = states.get(request_id)
            if state is None or request_id in running_ids or request_id in self._offloaded:
                continue
            # An idle state does not change: it is measured once per idle spell.
            num_bytes = self._idle_bytes.get(request_id)
            if num_bytes is None:
                num_bytes = self._idle_bytes[request_id] = self._device_bytes(state)
            if num_bytes <= room:
                self._offloaded[request_id] = self._offload(state, num_bytes)
                room -= num_bytes
                moved = True
        return moved

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what is kept for these requests (their states were released)."""
        for request_id in request_ids:
            self._last_ran.pop(request_id, None)
            self._idle_bytes.pop(request_id, None)
            self._offloaded.pop(request_id, None)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device.type

    def _device_bytes(self, state: StepRequestState) -> int:
        num_bytes = 0

        def count(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal num_bytes
            if self._on_device(tensor):
                num_bytes += tensor.nbytes
            return tensor

        map_state_tensors(state, count)
        return num_bytes

    def _offload(self, state: StepRequestState, num_bytes: int) -> _Offloaded:
        copies: list[torch.Tensor] = []

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            if not self._on_device(tensor):
                return tensor
            copies.append(self._host_copy(tensor))
            return copies[-1]

        map_state_tensors(state, to_host)
        return _Offloaded(num_bytes, copies)

    def _restore(self, state: StepRequestState, entry: _Offloaded) -> None:
        host_copies = {id(copy) for copy in entry.host_copies}

        def to_device(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in host_copies:
                return tensor
            return tensor.to(self.device, non_blocking=self._pin)

        map_state_tensors(state, to_device)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._pin:
            return tensor.to("cpu")
        # Same stream as the compute: later device work and the copy back are
        # ordered after this copy, so it need not be waited for.
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host


def map_state_tensors(state: StepRequestState, fn: TensorMap) -> None:
    """Replace each tensor ``t`` of ``state`` (see the module docstring for which)
    by ``fn(t)``, in place. ``fn`` is called once per distinct tensor: a tensor
    reached twice is replaced by the same result both times."""
    walk = _TensorWalk(fn)
    for name in _TENSOR_FIELDS:
        value = getattr(state, name)
        mapped = walk.map(value)
        if mapped is not value:
            setattr(state, name, mapped)


class _TensorWalk:
    """One pass over a state's values: containers and objects are updated in place,
    tuples rebuilt only when an item changed."""

    def __init__(self, fn: TensorMap) -> None:
        self.fn = fn
        self.visited: set[int] = set()
        # By id of the original, which is kept alive so that its id is not reused.
        self.results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def map(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, _OPAQUE) or callable(value):
            return value
        if id(value) in self.visited or _only_scalars(value):
            return value
        self.visited.add(id(value))
        if isinstance(value, (list, dict)):
            # Written only where a tensor changed: a config dict is left untouched.
            keys = range(len(value)) if isinstance(value, list) else list(value)
            for key in keys:
                item = value[key]
                mapped = self.map(item)
                if mapped is not item:
                    value[key] = mapped
        elif type(value) is tuple:
            items = tuple(self.map(item) for item in value)
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        elif attrs.has(type(value)):
            for field in attrs.fields(type(value)):
                self._attribute(value, field.name)
        elif hasattr(value, "__dict__"):
            for name in list(vars(value)):
                self._attribute(value, name)
        return value

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        known = self.results.get(id(tensor))
        if known is None:
            known = self.results[id(tensor)] = (tensor, self.fn(tensor))
        return known[1]

    def _attribute(self, owner: Any, name: str) -> None:
        item = getattr(owner, name)
        mapped = self.map(item)
        if mapped is not item:
            # object.__setattr__ also works for frozen and slotted classes.
            object.__setattr__(owner, name, mapped)


def _only_scalars(value: Any) -> bool:
    """A list or tuple of scalars (a schedule, timesteps): nothing to walk, checked fast."""
    return isinstance(value, (list, tuple)) and all(type(item) in _SCALAR_TYPES for item in value)
