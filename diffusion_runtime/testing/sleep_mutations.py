"""Sleep and wake bugs the core harness's sleep rules must catch (:mod:`.sleep_rules`)."""

from __future__ import annotations

from typing import Any

import torch

from diffusion_runtime.core import EngineCore, StepResult
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.runner import sleep as worker_sleep
from diffusion_runtime.runner.sleep import WorkerSleep
from diffusion_runtime.runner.weights import WeightSlot
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute


def wave_scheduled_while_asleep() -> Patch:
    def make(original: Any) -> Any:
        def step(self: EngineCore) -> StepResult:
            # "the workers know they sleep: the core need not check"
            level, self._sleep_level = self._sleep_level, None
            try:
                result: StepResult = original(self)
            finally:
                self._sleep_level = level
            return result

        return step

    return replace_attribute(EngineCore, "_step", make)


def level_2_reload_in_float64() -> Patch:
    def make(original: Any) -> Any:
        def reload(self: WorkerSleep) -> None:
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)  # "reload at full precision, lose nothing"
            try:
                original(self)
            finally:
                torch.set_default_dtype(default)

        return reload

    return replace_attribute(WorkerSleep, "_reload", make)


def level_2_keeps_buffers() -> Patch:
    def make(original: Any) -> Any:
        def parameter_slots(modules: Any) -> list[WeightSlot]:
            slots: list[WeightSlot] = original(modules)
            return [slot for slot in slots if slot.is_parameter]  # "weights are parameters"

        return parameter_slots

    return replace_attribute(worker_sleep, "weight_slots", make)


def waiting_dropped_at_sleep() -> Patch:
    def make(original: Any) -> Any:
        def sleep(self: EngineCore, level: int = 1) -> None:
            original(self, level)
            # "nothing starts while asleep: turn new requests away instead of holding them"
            for request in list(self.scheduler.waiting.values()):
                if request.state is RequestStatus.WAITING:
                    ended = self.scheduler.abort_request(request.request_id, "the engine sleeps")
                    if ended is not None:
                        self._pending.append(self._final_output(ended, None))

        return sleep

    return replace_attribute(EngineCore, "sleep", make)


SLEEP_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="wave-while-asleep", mode="step", target="core",
             bug="the core schedules waves while its workers sleep",
             patch=wave_scheduled_while_asleep),
    Mutation(name="level-2-reload-in-float64", mode="request", target="core",
             bug="a level-2 wake reloads the weights in float64", patch=level_2_reload_in_float64),
    Mutation(name="level-2-keeps-buffers", mode="step", target="core",
             bug="level 2 drops parameters and leaves buffers on the device",
             patch=level_2_keeps_buffers),
    Mutation(name="waiting-dropped-at-sleep", mode="request", target="core",
             bug="sleep aborts the requests waiting to start", patch=waiting_dropped_at_sleep),
)  # fmt: skip
