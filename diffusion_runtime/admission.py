"""What every front decides before a request reaches a core: its id and its seed."""

from __future__ import annotations

import itertools
import random
import secrets

from diffusion_runtime.errors import InvalidFieldError
from diffusion_runtime.sampling_params import MAX_SEED, SamplingParams

MAX_REQUEST_ID_LENGTH = 256


class RequestMinter:
    """Mints request ids (unique per front, prefixed per instance) and seeds.

    A request without a seed gets one drawn here, and its output reports it,
    so every result can be reproduced.
    """

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count()
        self._seeds = random.Random(secrets.randbits(64))

    def request_id(self, request_id: object = None) -> str:
        """A fresh id for ``None``; else ``request_id`` once checked."""
        if request_id is None:
            return f"{self._prefix}-{next(self._counter)}"
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH:
            raise InvalidFieldError(
                "request",
                "request_id",
                f"must be a non-empty str of at most {MAX_REQUEST_ID_LENGTH} characters",
                request_id,
            )
        return request_id

    def seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._seeds.randint(0, MAX_SEED)
