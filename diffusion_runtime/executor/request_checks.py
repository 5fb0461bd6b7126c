"""The check of a request at admission shared by the executors that send it to workers:
it must serialise, and a field that cannot is named."""

from __future__ import annotations

import pickle
from typing import Any

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.executor.portable import Serialiser
from diffusion_runtime.sampling_params import SamplingParams

# What a serialiser raises for a value it cannot serialise.
_REFUSALS = (pickle.PicklingError, AttributeError, TypeError, RecursionError)


def serialised_request(
    prompt: Any, params: SamplingParams, serialise: Serialiser, destination: str
) -> bytes:
    """``(prompt, params)`` as ``serialise`` makes them; else :class:`InvalidFieldError`
    naming ``extra_args`` if they are at fault, or else the prompt.

    The input bounds measure how deep lists, tuples, sets and dicts nest; a value
    nested through other objects may still be too deep to serialise.
    ``destination`` says where the request goes, for the error message.
    """
    try:
        return serialise((prompt, params))
    except _REFUSALS as exc:
        cause = exc
    try:
        serialise(params.extra_args)
    except _REFUSALS:
        owner, field, value = "SamplingParams", "extra_args", params.extra_args
    else:
        owner, field, value = "request", "prompt", prompt
    rule = f"must be picklable to reach {destination}"
    if _too_deep(cause):
        rule = "is nested too deeply to pickle"
    raise InvalidFieldError(owner, field, rule, value) from cause


def _too_deep(exc: BaseException) -> bool:
    # cloudpickle raises a PicklingError from the RecursionError.
    return isinstance(exc, RecursionError) or isinstance(exc.__cause__, RecursionError)
