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
        # The protocol's parameters first, in order; a front may add keyword-only ones
        # with defaults (the engine's grouped ``prompts``), and so make a required
        # one optional: it still accepts every call the protocol allows.
        count = len(expected.parameters)
        assert list(actual.parameters)[:count] == list(expected.parameters), (front, name, actual)
        for extra in list(actual.parameters.values())[count:]:
            assert extra.kind is inspect.Parameter.KEYWORD_ONLY, (front, name, extra.name)
            assert extra.default is not inspect.Parameter.empty, (front, name, extra.name)
        for parameter in list(expected.parameters.values())[1:]:
            got = actual.parameters[parameter.name]
            if (
                parameter.default is not inspect.Parameter.empty
                or not len(actual.parameters) > count
            ):
                assert (got.default is inspect.Parameter.empty) == (
                    parameter.default is inspect.Parameter.empty
                ), (front, name, parameter.name)
        is_async = inspect.iscoroutinefunction(getattr(Front, name))
        assert inspect.iscoroutinefunction(getattr(front, name)) == is_async, (front, name)
