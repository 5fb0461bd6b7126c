"""Long runs, skipped by default: `python -m pytest -m slow`."""

from __future__ import annotations

import pytest

from diffusion_runtime.testing.mutations import CATALOGUE, hunt, passes
from diffusion_runtime.testing.targets import core_harness, front_harness

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_real_runtime_survives_a_long_hunt(mode: str) -> None:
    passes(core_harness(mode), 400, steps=40)
    passes(front_harness(mode), 100, steps=40)


def test_every_mutation_is_caught_with_longer_sequences() -> None:
    missed = [
        m.name
        for m in CATALOGUE
        if m.target != "mp" and hunt(m, max_examples=200, steps=40) is None
    ]
    assert missed == []
