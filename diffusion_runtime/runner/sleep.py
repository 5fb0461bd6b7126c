"""Sleep and wake for one worker: free the device between waves, then restore it exactly.

- Level 1: every weight tensor (see :mod:`~diffusion_runtime.runner.weights`)
  is copied to host memory (pinned on CUDA) and its device storage freed; wake
  copies it back into the same parameter objects, bit for bit.
- Level 2: every weight tensor is dropped (it becomes a ``meta`` tensor: shape
  and dtype kept, no storage); wake calls the pipeline's ``reload_weights()``,
  which loads them again from its source, then checks that every tensor is
  back with its name, shape, dtype and device. A pipeline that holds weights
  but has no ``reload_weights`` refuses level 2.

At both levels the step states the runner holds (requests running between
steps, and preempted ones) move to host memory and come back at wake: unlike
weights they have no source to reload from, and a request is never cut short
or restarted by sleep. On a CPU device host memory *is* the device, so level 1
and the states move nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diffusion_runtime.errors import InvalidFieldError, PipelineContractError, SleepStateError
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.runner.state_offload import map_state_tensors
from diffusion_runtime.runner.weights import (
    TensorSpec,
    WeightSlot,
    weight_modules,
    weight_slots,
)

#: The sleep levels: 1 keeps weights in host memory, 2 drops them.
SLEEP_LEVELS = (1, 2)

_META = torch.device("meta")


def checked_sleep_level(level: object) -> int:
    """``level`` if it is a sleep level, else :class:`InvalidFieldError` (a ``ValueError``)."""
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise InvalidFieldError("sleep", "level", "must be 1 or 2", level)
    return level


class WorkerSleep:
    """Puts one worker's pipeline and runner states to sleep and wakes them."""

    def __init__(self, pipeline: Any, runner: ModelRunner, device: torch.device) -> None:
        self.pipeline = pipeline
        self.runner = runner
        self.device = device
        self._pin = device.type == "cuda"
        self.level: int | None = None
        # Level 1: host copies and where each came from, in slot order.
        self._host_weights: list[tuple[torch.Tensor, torch.device]] = []
        # Level 2: what each weight must be after the reload, by name.
        self._specs: dict[str, TensorSpec] = {}
        # The host copies of the states' tensors: these, and only these, go back.
        self._host_states: dict[str, set[int]] = {}

    @property
    def is_sleeping(self) -> bool:
        return self.level is not None

    def sleep(self, level: int) -> None:
        """Free the device's memory at ``level``; the caller runs no wave meanwhile.

        Nothing changes when it raises: host copies are made before any weight
        is replaced, and states already parked come back.
        """
        level = checked_sleep_level(level)
        if self.level is not None:
            raise SleepStateError(f"the worker is already asleep (level {self.level})")
        slots = weight_slots(weight_modules(self.pipeline))
        if level == 2 and slots and not callable(getattr(self.pipeline, "reload_weights", None)):
            raise PipelineContractError(
                f"sleep level 2 drops the weights, and {type(self.pipeline).__name__} has no "
                "reload_weights() to load them again; use level 1"
            )
        host_weights = (
            [(self._to_host(slot.get()), slot.get().device) for slot in slots] if level == 1 else []
        )
        try:
            self._park_states()
        except BaseException:
            self._unpark_states()
            raise
        if level == 1:
            self._host_weights = host_weights
            _replace_each(slots, [host for host, _ in host_weights])
        else:
            self._specs = {slot.name: TensorSpec.of(slot.get()) for slot in slots}
            _replace_each(slots, [slot.get().to(_META) for slot in slots], keep_identity=False)
        self.level = level
        if self._pin:
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Restore the weights and states exactly as they were before :meth:`sleep`.

        A no-op while awake, so that a wake that failed on some workers of a
        group can be retried on all of them (the core refuses a wake while
        awake). A wake that raises (no room on the device yet, a failed reload)
        leaves the worker asleep; it may be called again.
        """
        if self.level is None:
            return
        if self._host_weights:  # level 1: every copy is made before any is put back
            slots = weight_slots(weight_modules(self.pipeline))
            _replace_each(slots, [host.to(device) for host, device in self._host_weights])
            self._host_weights = []
        if self._specs:
            self._reload()
        self._unpark_states()
        self.level = None

    def _reload(self) -> None:
        """Level 2: the pipeline reloads; every weight must come back as it was."""
        self.pipeline.reload_weights()
        now = {slot.name: slot.get() for slot in weight_slots(weight_modules(self.pipeline))}
        wrong = [
            f"{name}: {TensorSpec.of(now[name]) if name in now else 'missing'} != {spec}"
            for name, spec in self._specs.items()
            if name not in now or TensorSpec.of(now[name]) != spec
        ]
        if wrong:
            raise PipelineContractError(
                f"reload_weights() of {type(self.pipeline).__name__} did not restore "
                f"{len(wrong)} weight(s): {'; '.join(wrong[:3])}"
            )
        self._specs = {}

    def _park_states(self) -> None:
        runner = self.runner
        offloaded = set(runner.offloaded_request_ids())
        self._host_states = {}
        for request_id, state in runner.states.items():
            if request_id not in offloaded:
                moved = self._host_states[request_id] = set()
                map_state_tensors(state, self._state_mover(moved))
        runner.input_batch.invalidate()

    def _unpark_states(self) -> None:
        runner = self.runner
        for request_id, moved in self._host_states.items():
            state = runner.states.get(request_id)
            if state is not None and moved:  # else it ended while asleep
                map_state_tensors(state, self._state_restorer(moved))
        self._host_states = {}
        runner.input_batch.invalidate()

    def _state_mover(self, moved: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type != self.device.type or tensor.device.type == "cpu":
                return tensor
            host = self._to_host(tensor)
            moved.add(id(host))
            return host

        return to_host

    def _state_restorer(self, moved: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def to_device(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(self.device) if id(tensor) in moved else tensor

        return to_device

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        if not self._pin:
            return tensor.to("cpu")
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor)
        return host


def _replace_each(
    slots: list[WeightSlot], tensors: list[torch.Tensor], *, keep_identity: bool = True
) -> None:
    """Put ``tensors[i]`` into ``slots[i]`` (see :meth:`WeightSlot.put` and
    :meth:`WeightSlot.replace`); a tensor shared by several slots gets the first
    replacement made for it, so shared weights stay shared."""
    # By id of the old tensor, kept alive with its replacement so that no id is reused.
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for slot, tensor in zip(slots, tensors, strict=True):
        old = slot.get()
        known = first.get(id(old))
        if known is not None:
            setattr(slot.owner, slot.attribute, known[1])
            continue
        if keep_identity:
            slot.put(tensor)
        else:
            slot.replace(tensor)
        first[id(old)] = (old, slot.get())
