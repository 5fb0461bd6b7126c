"""The ``slo`` benchmark's traces replayed against the real step scheduler on a virtual clock.

The scheduler, its policy and the request machine are the real ones; the
workers are replaced by a clock that advances a fixed :data:`STEP_S` per step
whatever the batch (as the digits model does on a CPU up to 32 image rows),
plus :data:`OVERHEAD_S` per request for admission, decoding and delivery. The
figures show what each policy decides, free of the noise of a shared machine,
and are exactly reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diffusion_runtime.bench.slo_trace import Arrival
from diffusion_runtime.bench.stats import percentile
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.fsm import RequestMachine, RequestStatus
from diffusion_runtime.scheduler import Request, StepScheduler

#: Seconds one denoising step takes (the digits core step measured at batch 1 to 8).
STEP_S = 0.0013
#: Seconds a request costs outside its steps.
OVERHEAD_S = 0.001


def solo_latency(arrival: Arrival) -> float:
    return arrival.kind.steps * STEP_S + OVERHEAD_S


def simulate(
    policy: str, trace: list[Arrival], scale: float, max_num_seqs: int
) -> dict[str, float]:
    """Attainment at ``scale`` and the short class's p99 latency (ms) of one replay."""
    deadlines = {a.kind.name: scale * solo_latency(a) for a in trace}
    latencies = replay(policy, trace, deadlines, max_num_seqs)
    met = sum(latencies[a.seed] <= deadlines[a.kind.name] for a in trace)
    short = [latencies[a.seed] for a in trace if a.kind.name == "short"]
    return {
        "attainment": round(met / len(trace), 3),
        "short_p99_ms": round(percentile(short, 99) * 1e3, 1),
    }


def replay(
    policy: str,
    trace: Sequence[Arrival],
    deadlines: Mapping[str, float | None],
    max_num_seqs: int,
) -> dict[int, float]:
    """Each request's latency (by its seed, which must be unique in ``trace``) when
    ``policy`` serves ``trace`` with ``deadlines`` (seconds, by class name)."""
    clock = [0.0]
    scheduler = StepScheduler(
        RequestMachine(),
        EngineConfig(execution_mode="step", max_num_seqs=max_num_seqs, scheduling_policy=policy),
    )
    scheduler.clock = lambda: clock[0]
    pending = sorted(trace, key=lambda a: a.offset_s)
    latencies: dict[int, float] = {}
    while pending or scheduler.requests:
        while pending and pending[0].offset_s <= clock[0]:
            arrival = pending.pop(0)
            params = arrival.kind.params(arrival.seed, deadlines[arrival.kind.name])
            key = scheduler.batch_key_for(params)
            request = Request(str(arrival.seed), "0", params, 0, key, arrival.offset_s)
            scheduler.add_request(request)
        output = scheduler.schedule(clock[0])
        if output is None or not output.has_work:
            clock[0] = pending[0].offset_s
            continue
        clock[0] += STEP_S
        for ended in _one_step(scheduler, output):
            latencies[int(ended.request_id)] = clock[0] + OVERHEAD_S - ended.arrival_time
    return latencies


def _one_step(scheduler: StepScheduler, output: SchedulerOutput) -> list[Request]:
    """Advance every scheduled request by one step; the requests that completed."""
    progress, images = {}, {}
    for rid in output.scheduled_ids:
        request = scheduler.requests[rid]
        total = request.params.num_inference_steps
        progress[rid] = (request.step_index + 1, total)
        if request.step_index + 1 == total:
            images[rid] = torch.zeros(1, 1, 1, 1)
    scheduler.cost_meter.wave_ran(output, scheduler.clock())  # as the engine core does
    ended = scheduler.update_from_output(
        output, RunnerOutput(output.wave_id, images, progress=progress)
    )
    return [e.request for e in ended if e.event.dest is RequestStatus.FINISHED_COMPLETED]
