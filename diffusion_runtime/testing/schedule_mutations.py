"""Bugs in how a request's custom schedule (``SamplingParams.timesteps``) reaches its
pipeline, which the ``outputs`` target must catch: its oracle runs each request
alone on the schedule the request brought."""

from __future__ import annotations

from typing import Any

import attrs

from diffusion_runtime.contracts import NewRequestData
from diffusion_runtime.pipelines.protocols import PipelineRequest
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.testing.mutation import Mutation, Patch
from diffusion_runtime.testing.patching import replace_attribute


def joiner_on_the_default_schedule() -> Patch:
    def make(original: Any) -> Any:
        def pipeline_request(self: ModelRunner, data: NewRequestData) -> PipelineRequest:
            if self.step_mode and self.states and data.params.timesteps is not None:
                # "a step batch shares one schedule shape (the step batch key has no
                # timesteps): a request joining it steps on its step count's schedule"
                data = attrs.evolve(data, params=attrs.evolve(data.params, timesteps=None))
            request: PipelineRequest = original(self, data)
            return request

        return pipeline_request

    return replace_attribute(ModelRunner, "_pipeline_request", make)


SCHEDULE_MUTATIONS: tuple[Mutation, ...] = (
    Mutation(name="custom-timesteps-ignored-on-join", mode="step", target="outputs",
             bug="in step mode, a request that joins running ones gets the default "
                 "schedule of its step count instead of its custom timesteps",
             patch=joiner_on_the_default_schedule),
)  # fmt: skip
