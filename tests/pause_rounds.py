"""Pause, admit, abort, resume, repeated: what every front and executor must pass.

Each round pauses the engine, admits three compatible requests one after
another and a fourth that it aborts at once, then resumes. The first schedule
after ``resume()`` must start the three together (no split), and the aborted
one must never reach a wave (no late abort).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from diffusion_runtime import DiffusionEngine, SamplingParams
from diffusion_runtime.fsm import RequestStatus
from diffusion_runtime.fsm.events import TraceEvent, WaveEvent
from diffusion_runtime.outputs import RequestOutput

#: How many rounds a front or executor must pass in a row.
ROUNDS = 300


def check_round(
    together: Sequence[str],
    victim: str,
    finals: dict[str, RequestOutput],
    waves: Sequence[WaveEvent],
) -> None:
    """The three ran from one wave on, and the aborted one ran in none."""
    assert finals[victim].status is RequestStatus.FINISHED_ABORTED, finals[victim]
    for rid in together:
        assert finals[rid].ok, finals[rid]
    starts = [set(w.new_ids) & set(together) for w in waves if set(w.new_ids) & set(together)]
    assert starts and starts[0] == set(together), f"the requests started apart: {starts}"
    ran = [w.wave_id for w in waves if victim in w.scheduled_ids]
    assert not ran, f"{victim!r} was aborted while paused, yet ran in waves {ran}"


def run_rounds(
    engine: DiffusionEngine, params: Sequence[SamplingParams], rounds: int = ROUNDS
) -> None:
    """``rounds`` rounds on ``engine``; ``params`` gives the three requests' parameters."""
    waves: list[WaveEvent] = []

    def keep_waves(event: TraceEvent) -> None:
        if isinstance(event, WaveEvent):
            waves.append(event)

    engine.machine.subscribe(keep_waves)
    loop = asyncio.new_event_loop()
    try:
        for number in range(rounds):
            seen = len(waves)
            together, victim, finals = loop.run_until_complete(one_round(engine, params))
            try:
                check_round(together, victim, finals, waves[seen:])
            except AssertionError as exc:
                raise AssertionError(f"round {number} of {rounds}: {exc}") from None
    finally:
        loop.close()


async def one_round(
    engine: DiffusionEngine, params: Sequence[SamplingParams]
) -> tuple[list[str], str, dict[str, RequestOutput]]:
    engine.pause()
    together = [await engine.add_request(str(i), p) for i, p in enumerate(params)]
    victim = await engine.add_request("9", params[0])
    engine.abort(victim)
    engine.resume()
    finals = {}
    for rid in [*together, victim]:
        finals[rid] = [output async for output in engine.stream(rid)][-1]
    return together, victim, finals
