"""Hypothesis strategies for requests: sampling parameters, prompts and request mixes."""

from __future__ import annotations

from typing import Any

import attrs
import hypothesis.strategies as st

from diffusion_runtime.sampling_params import SamplingParams

#: What :func:`sampling_params` draws with ``output_options``.
OUTPUT_OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "output_type": st.sampled_from(["pil", "latent"]),
    "return_trajectory": st.sampled_from([False, "latents", "full"]),
    "extra_args": st.sampled_from([{}, {"noise": 0.5}]),
}


def custom_timesteps(steps: tuple[int, int]) -> st.SearchStrategy[tuple[int, ...] | None]:
    """``None``, or strictly decreasing whole timesteps in ``[0, 12]``, as many as
    ``steps`` allows (what the testing pipelines take): the choice is an integer drawn
    in ``[0, 2]``, 0 giving timesteps (which leaves the other draws' reach of the
    ``outputs`` target well above its required counts)."""
    lists = st.lists(st.integers(0, 12), min_size=steps[0], max_size=steps[1], unique=True)
    custom = lists.map(lambda values: tuple(sorted(values, reverse=True)))
    return st.integers(0, 2).flatmap(lambda pick: custom if pick == 0 else st.none())


#: ``SamplingParams.cache`` values drawn with ``caches``: the engine's, none, never
#: skipping, and thresholds that skip some or most steps of a few-step request.
CACHE_SETTINGS: tuple[bool | dict[str, Any] | None, ...] = (
    None,
    False,
    {"rel_l1_thresh": 0.0},
    {"rel_l1_thresh": 0.6, "warmup_steps": 0},
    {"rel_l1_thresh": 2.0, "max_consecutive_skips": 2},
)


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
    schedules: bool = False,
    stream_trajectories: bool = False,
    caches: bool = False,
) -> st.SearchStrategy[SamplingParams]:
    """Valid, cheap sampling parameters with an explicit seed; ``priorities``
    bounds the drawn ``priority`` (a preemptive policy preempts on it) and
    ``deadlines`` draws ``deadline_s`` (default: no deadline). With
    ``output_options``, ``output_type`` and ``return_trajectory`` are drawn too,
    and ``extra_args={"noise": ...}`` (the testing pipelines' stochastic steps).
    With ``schedules``, some requests bring :func:`custom_timesteps`. With
    ``stream_trajectories`` (an engine with ``streaming_output``), a request
    that asks for a trajectory streams it half the time. With ``caches``,
    ``cache`` is drawn from :data:`CACHE_SETTINGS` (an engine with a step cache).

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
            **({"timesteps": custom_timesteps(steps)} if schedules else {}),
            **({"cache": st.sampled_from(CACHE_SETTINGS)} if caches else {}),
        )

    drawn = st.sampled_from(sizes or [None]).flatmap(with_size)
    if not stream_trajectories:
        return drawn
    return drawn.flatmap(
        lambda params: st.builds(
            lambda streams: attrs.evolve(params, stream_trajectory=streams),
            st.booleans() if params.return_trajectory else st.just(False),
        )
    )


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
