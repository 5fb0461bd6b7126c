"""Every front offers the same request API (the :class:`Front` protocol)."""

from __future__ import annotations

import inspect

import pytest

from diffusion_runtime import DiffusionEngine
from diffusion_runtime.front import Front
from diffusion_runtime.replicas import ReplicaSet
from diffusion_runtime.stage import StageClient

METHODS = ("add_request", "stream", "abort")


@pytest.mark.parametrize(
    "front", [DiffusionEngine, StageClient, ReplicaSet], ids=lambda c: c.__name__
)
def test_every_front_admits_streams_and_aborts_as_the_protocol_says(front: type) -> None:
    for name in METHODS:
        expected = inspect.signature(getattr(Front, name))
        actual = inspect.signature(getattr(front, name))
        assert list(actual.parameters) == list(expected.parameters), (front, name, actual)
        for parameter in list(expected.parameters.values())[1:]:
            got = actual.parameters[parameter.name]
            assert (got.default is inspect.Parameter.empty) == (
                parameter.default is inspect.Parameter.empty
            ), (front, name, parameter.name)
        is_async = inspect.iscoroutinefunction(getattr(Front, name))
        assert inspect.iscoroutinefunction(getattr(front, name)) == is_async, (front, name)
