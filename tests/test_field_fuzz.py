"""Every field of EngineConfig and SamplingParams answers any value with a value
or an InvalidFieldError that names it, in a message of bounded length."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_runtime import EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.errors import MAX_VALUE_REPR
from diffusion_runtime.sampling_params import checked_params, prompts_and_params
from diffusion_runtime.validation import MAX_INPUT_BYTES, MAX_INPUT_DEPTH

#: Examples per class: 300 under the "ci" profile (50 examples), 3,000 under "thorough".
EXAMPLES = settings().max_examples * 6


def nested_list(depth: int) -> list[Any]:
    root: list[Any] = []
    inner = root
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return root


extremes = st.sampled_from(
    [10**400, -(10**400), 2**70, 2**63, -1, 0, math.nan, math.inf, -math.inf, -0.0, 1e308]
)
leaves = st.one_of(
    st.from_type(object),
    extremes,
    st.integers(),
    st.floats(),
    st.binary(),
    st.text(),
    st.none(),
    st.booleans(),
)
any_value = st.one_of(
    leaves,
    st.recursive(leaves, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)),
    st.integers(0, 3 * MAX_INPUT_DEPTH).map(nested_list),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3 * MAX_INPUT_DEPTH).map(nested_list)),
)


def field_values(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    names = [field.name for field in attrs.fields(cls)]
    return st.fixed_dictionaries({}, optional=dict.fromkeys(names, any_value))


def build_or_refuse(cls: type, kwargs: dict[str, Any]) -> None:
    try:
        cls(**kwargs)
    except InvalidFieldError as exc:
        assert exc.owner == cls.__name__
        assert exc.field in kwargs
        assert len(str(exc)) < 2 * MAX_VALUE_REPR + 300


@settings(max_examples=EXAMPLES)
@given(field_values(EngineConfig))
def test_engine_config_answers_any_value_with_an_invalid_field_error(
    kwargs: dict[str, Any],
) -> None:
    build_or_refuse(EngineConfig, kwargs)


@settings(max_examples=EXAMPLES)
@given(field_values(SamplingParams))
def test_sampling_params_answer_any_value_with_an_invalid_field_error(
    kwargs: dict[str, Any],
) -> None:
    build_or_refuse(SamplingParams, kwargs)


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (SamplingParams, "guidance_scale", 10**400),
        (EngineConfig, "shutdown_grace_s", 10**400),
        (EngineConfig, "worker_liveness_timeout_s", -(10**400)),
        (EngineConfig, "worker_extensions", 0),
        (EngineConfig, "worker_extensions", "pkg:Ext"),
        (EngineConfig, "device", 2**70),
        (EngineConfig, "device", b"\xa2"),
        (EngineConfig, "executor_backend", int),
        (EngineConfig, "execution_mode", ["step"]),
        (EngineConfig, "trace_path", "a\0b"),
        (SamplingParams, "extra_args", {"deep": nested_list(MAX_INPUT_DEPTH)}),
        (SamplingParams, "extra_args", {"big": "x" * (MAX_INPUT_BYTES + 1)}),
    ],
)
def test_reported_bad_values_name_their_field(cls: type, field: str, value: Any) -> None:
    with pytest.raises(InvalidFieldError) as info:
        cls(**{field: value})
    assert (info.value.owner, info.value.field) == (cls.__name__, field)
    assert len(str(info.value)) < 2 * MAX_VALUE_REPR + 300


def test_params_of_the_wrong_type_say_what_they_got() -> None:
    with pytest.raises(InvalidFieldError, match="not dict"):
        prompts_and_params(["a", "b"], {"seed": 1})  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="not dict"):
        checked_params({"seed": 1})


def test_a_bad_prompt_among_many_is_named_by_its_index() -> None:
    prompts: list[Any] = ["ok"] * 10_000
    prompts[7_321] = nested_list(MAX_INPUT_DEPTH + 1)
    with pytest.raises(InvalidFieldError) as info:
        prompts_and_params(prompts, None)
    assert info.value.field == "prompts[7321]"
    assert "nest deeper" in str(info.value)


def test_a_huge_value_is_echoed_short() -> None:
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(seed="7" * 10_000_000)  # type: ignore[arg-type]
    assert len(str(info.value)) < 2 * MAX_VALUE_REPR + 300
    assert info.value.value == "7" * 10_000_000
