"""Hypothesis strategies for requests: sampling parameters, prompts and request mixes."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st

from diffusion_runtime.sampling_params import SamplingParams

#: What :func:`sampling_params` draws with ``output_options``.
OUTPUT_OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "output_type": st.sampled_from(["pil", "latent"]),
    "return_trajectory": st.sampled_from([False, "latents", "full"]),
    "extra_args": st.sampled_from([{}, {"noise": 0.5}]),
}


def sampling_params(
    *,
    steps: tuple[int, int] = (1, 3),
    outputs: tuple[int, int] = (1, 2),
    guidance: list[float] | None = None,
    sizes: list[int | None] | None = None,
    seeds: st.SearchStrategy[int] | None = None,
    priorities: tuple[int, int] = (0, 0),
    deadlines: st.SearchStrategy[float | None] | None = None,
    output_options: bool = False,
) -> st.SearchStrategy[SamplingParams]:
    """Valid, cheap sampling parameters with an explicit seed; ``priorities``
    bounds the drawn ``priority`` (a preemptive policy preempts on it) and
    ``deadlines`` draws ``deadline_s`` (default: no deadline). With
    ``output_options``, ``output_type`` and ``return_trajectory`` are drawn too,
    and ``extra_args={"noise": ...}`` (the testing pipelines' stochastic steps).

    Small seed and step ranges make equal requests likely, which lets the
    identity checks compare outputs of equal inputs in different batches.
    """

    def with_size(size: int | None) -> st.SearchStrategy[SamplingParams]:
        return st.builds(
            SamplingParams,
            num_inference_steps=st.integers(*steps),
            guidance_scale=st.sampled_from(guidance or [1.0]),
            seed=seeds if seeds is not None else st.integers(0, 3),
            num_outputs_per_prompt=st.integers(*outputs),
            height=st.just(size),
            width=st.just(size),
            priority=st.integers(*priorities),
            deadline_s=deadlines if deadlines is not None else st.none(),
            **(OUTPUT_OPTIONS if output_options else {}),
        )

    return st.sampled_from(sizes or [None]).flatmap(with_size)


def digit_prompts() -> st.SearchStrategy[Any]:
    """Prompts for the built-in digits pipeline: digits as ints or strings."""
    return st.integers(0, 9) | st.integers(0, 9).map(str)


def request_mixes(
    prompts: st.SearchStrategy[Any],
    params: st.SearchStrategy[SamplingParams] | None = None,
    *,
    max_size: int = 8,
) -> st.SearchStrategy[list[tuple[Any, SamplingParams]]]:
    """Lists of ``(prompt, params)``: a burst of requests arriving together."""
    return st.lists(
        st.tuples(prompts, params if params is not None else sampling_params()),
        min_size=1,
        max_size=max_size,
    )
