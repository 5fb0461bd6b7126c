"""How outputs print: one short line a person can read, never the pixels."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from diffusion_runtime import DiffusionEngine, RequestOutput, SamplingParams


def test_a_completed_output_prints_its_id_status_and_image_shape(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("digits", warmup=False)
    params = SamplingParams(num_inference_steps=2, seed=5, num_outputs_per_prompt=3)
    [out] = engine.generate(["3"], params)
    assert (
        repr(out)
        == f"RequestOutput({out.request_id!r}, FINISHED_COMPLETED, 3 images (1, 8, 8), seed=5)"
    )


def test_a_failed_output_prints_its_error_and_no_images(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("testing-faults", warmup=False)
    [out] = engine.generate(["fail"], SamplingParams(num_inference_steps=2, seed=1))
    assert repr(out) == (
        f"RequestOutput({out.request_id!r}, FINISHED_ERROR, seed=1, "
        "error='RuntimeError: injected failure')"
    )


def test_an_intermediate_output_prints_its_progress(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("testing-noise", streaming_output=True)

    async def outputs() -> list[RequestOutput]:
        rid = await engine.add_request("a", SamplingParams(num_inference_steps=3, seed=2))
        return [out async for out in engine.stream(rid)]

    first, second, final = asyncio.run(outputs())
    rid = first.request_id
    assert repr(first) == f"RequestOutput({rid!r}, RUNNING, intermediate, step 1/3, seed=2)"
    assert repr(second) == f"RequestOutput({rid!r}, RUNNING, intermediate, step 2/3, seed=2)"
    shape = tuple(final.images[0].shape)
    assert (
        repr(final)
        == f"RequestOutput({rid!r}, FINISHED_COMPLETED, step 3/3, 1 image {shape}, seed=2)"
    )
