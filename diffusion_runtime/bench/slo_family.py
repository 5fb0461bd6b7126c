"""``bench slo --family``: every policy on a family of generated traces.

Each trace is drawn from its seed: a burst shape (the long requests first and
the short ones streaming in after them, the short ones first, the classes
interleaved, or Poisson arrivals of mixed classes), two or three step-count
classes, a deadline scale (1.2 to 3.0 times each class's solo latency), a
``max_num_seqs`` (2 to 8) and a load (0.8 to 1.6 times what the slots can
serve). Every policy replays every trace on the virtual clock
(:mod:`diffusion_runtime.bench.slo_sim`: exact, and fast); a sample of the
traces is also served on the real engine (digits, step mode), in rounds that
measure the solo latencies again and rotate the order of the policies.

Reported per policy and scale: attainment, and for each class the number of
requests that missed their deadline with the median and p99 of their
latency; per trace, the deadlines each policy met and the median latency of
its requests that missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from diffusion_runtime.bench.slo import POLICIES, Outcome, policy_engines, replay, solo_latencies
from diffusion_runtime.bench.slo_sim import STEP_S, solo_latency
from diffusion_runtime.bench.slo_sim import replay as replay_virtual
from diffusion_runtime.bench.slo_trace import Arrival, RequestClass
from diffusion_runtime.bench.stats import percentile

SHAPES = ("long-first", "short-first", "interleaved", "poisson")
FAMILY_SCALES = (1.2, 1.5, 2.0, 3.0)
SLOTS = (2, 3, 4, 6, 8)


@attrs.frozen
class FamilyTrace:
    """One generated trace: its arrivals, and the scale and ``max_num_seqs`` it is served at."""

    name: str
    shape: str
    scale: float
    max_num_seqs: int
    classes: tuple[RequestClass, ...]
    arrivals: tuple[Arrival, ...]


def _classes(rng: random.Random, count: int) -> tuple[RequestClass, ...]:
    steps = {
        "short": rng.randint(6, 12),
        "medium": rng.randint(18, 30),
        "long": rng.randint(40, 100),
    }
    names = ("short", "long") if count == 2 else ("short", "medium", "long")
    return tuple(
        RequestClass(name, steps[name], outputs=1, size=None, share=1 / count, priority=index)
        for index, name in enumerate(names)
    )


def generate(index: int, requests: int = 24, seed: int = 0) -> FamilyTrace:
    """Trace ``index`` of the family: its shape and scale cycle with ``index``, the
    rest is drawn from ``(seed, index)``."""
    rng = random.Random(f"{seed}/{index}")
    shape = SHAPES[index % len(SHAPES)]
    scale = FAMILY_SCALES[index // len(SHAPES) % len(FAMILY_SCALES)]
    slots = rng.choice(SLOTS)
    classes = _classes(rng, rng.choice((2, 3)))
    short, long = classes[0], classes[-1]
    # A quarter long (a third of two classes), a quarter medium, the rest short.
    kinds = [long] * (requests // (len(classes) + 1)) + [classes[1]] * (
        requests // 4 if len(classes) == 3 else 0
    )
    kinds += [short] * (requests - len(kinds))
    mean_steps = statistics.fmean(kind.steps for kind in kinds)
    rate = rng.uniform(0.8, 1.6) * slots / (mean_steps * STEP_S)
    burst: list[RequestClass] = []
    if shape == "poisson":
        rng.shuffle(kinds)
        stream = kinds
    elif shape == "interleaved":
        stream = _interleave(kinds)
    else:
        first_long = shape == "long-first"
        burst = [k for k in kinds if (k is long) == first_long]
        stream = [k for k in kinds if (k is long) != first_long]
        rng.shuffle(stream)
    arrivals, t = [Arrival(0.0, kind, number) for number, kind in enumerate(burst)], 0.0
    for kind in stream:
        t += rng.expovariate(rate)
        arrivals.append(Arrival(t, kind, len(arrivals)))
    name = f"{index:02d}-{shape}-x{scale}-seqs{slots}-{len(classes)}classes"
    return FamilyTrace(name, shape, scale, slots, classes, tuple(arrivals))


def _interleave(kinds: list[RequestClass]) -> list[RequestClass]:
    """``kinds`` with each class spread evenly over the whole list."""
    groups: dict[str, list[RequestClass]] = {}
    for kind in kinds:
        groups.setdefault(kind.name, []).append(kind)
    spread = [
        ((index + 0.5) / len(group), number, kind)
        for number, group in enumerate(groups.values())
        for index, kind in enumerate(group)
    ]
    return [kind for *_, kind in sorted(spread, key=lambda entry: entry[:2])]


def family(count: int = 24, requests: int = 24, seed: int = 0) -> list[FamilyTrace]:
    return [generate(index, requests, seed) for index in range(count)]


def virtual_deadlines(trace: FamilyTrace) -> dict[str, float | None]:
    return {kind.name: trace.scale * solo_latency(Arrival(0.0, kind, 0)) for kind in trace.classes}


@attrs.frozen
class Served:
    """One policy's replay of one trace: each request's class, latency and whether it
    met its deadline."""

    outcomes: tuple[Outcome, ...]

    @property
    def met(self) -> int:
        return sum(outcome.ok for outcome in self.outcomes)

    def missed_latencies(self, kind: str | None = None) -> list[float]:
        return [
            o.latency_s for o in self.outcomes if not o.ok and (kind is None or o.kind.name == kind)
        ]

    def missed_median_s(self) -> float | None:
        missed = self.missed_latencies()
        return statistics.median(missed) if missed else None


def serve_virtual(policy: str, trace: FamilyTrace) -> Served:
    """``policy`` on ``trace`` on the virtual clock."""
    deadlines = virtual_deadlines(trace)
    latencies = replay_virtual(policy, trace.arrivals, deadlines, trace.max_num_seqs)
    return Served(
        tuple(
            Outcome(a.kind, latencies[a.seed], latencies[a.seed] <= (deadlines[a.kind.name] or 0))
            for a in trace.arrivals
        )
    )


@attrs.frozen
class Targets:
    """The issue's targets for ``slo`` on one trace: it meets at least as many deadlines
    as the best other policy less one (``attainment``), and the median latency of its
    requests that missed is at most twice ``edf``'s (``lateness``; where ``edf``
    missed none, twice the median latency ``edf`` gave the requests ``slo`` missed)."""

    slo_met: int
    best_other_met: int
    edf_met: int
    slo_missed_median_s: float | None
    edf_missed_median_s: float | None

    @property
    def attainment(self) -> bool:
        return self.slo_met >= self.best_other_met - 1

    @property
    def lateness(self) -> bool:
        mine, theirs = self.slo_missed_median_s, self.edf_missed_median_s
        return mine is None or (theirs is not None and mine <= 2 * theirs)


def targets(served: dict[str, Served]) -> Targets:
    slo, edf = served["slo"], served["edf"]
    theirs = edf.missed_median_s()
    if theirs is None and slo.missed_median_s() is not None:
        missed = [i for i, outcome in enumerate(slo.outcomes) if not outcome.ok]
        theirs = statistics.median(edf.outcomes[i].latency_s for i in missed)
    return Targets(
        slo_met=slo.met,
        best_other_met=max(served[policy].met for policy in POLICIES if policy != "slo"),
        edf_met=edf.met,
        slo_missed_median_s=slo.missed_median_s(),
        edf_missed_median_s=theirs,
    )


def summary(
    runs: Iterable[tuple[FamilyTrace, dict[str, Served]]],
) -> dict[str, dict[str, Any]]:
    """Per scale and policy: attainment, and per class the requests that missed with
    the median and p99 of their latency (ms)."""
    by_scale: dict[str, dict[str, list[Served]]] = {}
    for trace, served in runs:
        for policy, one in served.items():
            by_scale.setdefault(str(trace.scale), {}).setdefault(policy, []).append(one)
    table: dict[str, dict[str, Any]] = {}
    for scale, policies in sorted(by_scale.items()):
        for policy, replays in policies.items():
            outcomes = [o for one in replays for o in one.outcomes]
            missed: dict[str, Any] = {}
            for kind in sorted({o.kind.name for o in outcomes}):
                late = [o.latency_s for o in outcomes if o.kind.name == kind and not o.ok]
                missed[kind] = {"missed": len(late)}
                if late:
                    missed[kind]["p50_ms"] = round(percentile(late, 50) * 1e3, 1)
                    missed[kind]["p99_ms"] = round(percentile(late, 99) * 1e3, 1)
            table.setdefault(scale, {})[policy] = {
                "attainment": round(sum(o.ok for o in outcomes) / len(outcomes), 3),
                "missed_by_class": missed,
            }
    return table


def per_trace(runs: Iterable[tuple[FamilyTrace, dict[str, Served]]]) -> dict[str, Any]:
    """Per trace and policy: the deadlines met, and the median latency (ms) of the
    requests that missed (``None``: none did)."""
    rows: dict[str, Any] = {}
    for trace, served in runs:
        row: dict[str, Any] = {"requests": len(trace.arrivals)}
        for policy, one in served.items():
            median = one.missed_median_s()
            row[policy] = {
                "met": one.met,
                "missed_median_ms": None if median is None else round(median * 1e3, 1),
            }
        rows.setdefault(trace.name, []).append(row)
    return rows


def sample(traces: Sequence[FamilyTrace], count: int) -> list[FamilyTrace]:
    """``count`` traces spread over the family: evenly spaced, each one further along
    the cycle of shapes than the one before (so over the shapes and the scales)."""
    count = min(max(count, 0), len(traces))
    chosen: list[int] = []
    for i in range(count):
        index = (i * len(traces) // count + i) % len(traces)
        while index in chosen:
            index = (index + 1) % len(traces)
        chosen.append(index)
    return [traces[index] for index in chosen]


def serve_real(trace: FamilyTrace, rounds: int, solo_repeats: int) -> list[dict[str, Served]]:
    """Every policy on ``trace`` through the real engine, ``rounds`` times: each round
    measures the solo latencies again (the deadlines are ``scale`` times them) and
    serves the trace with every policy, in an order that rotates from round to round."""
    with contextlib.ExitStack() as stack:
        engines = policy_engines(stack, trace.max_num_seqs)
        served = []
        for round_index in range(rounds):
            solo = solo_latencies(engines["fifo"], solo_repeats, trace.classes)
            deadlines: dict[str, float | None] = {n: trace.scale * s for n, s in solo.items()}
            order = (
                POLICIES[round_index % len(POLICIES) :] + POLICIES[: round_index % len(POLICIES)]
            )
            this_round = {}
            for policy in order:
                outcomes, _ = asyncio.run(replay(engines[policy], list(trace.arrivals), deadlines))
                this_round[policy] = Served(
                    tuple(
                        attrs.evolve(o, ok=o.ok and o.latency_s <= (deadlines[o.kind.name] or 0))
                        for o in outcomes
                    )
                )
            served.append({policy: this_round[policy] for policy in POLICIES})
    return served


def run(
    traces: int = 24,
    requests: int = 24,
    seed: int = 0,
    real_traces: int = 6,
    rounds: int = 3,
    solo_repeats: int = 3,
) -> dict[str, Any]:
    """The family on the virtual clock, and ``real_traces`` of it on the real engine."""
    generated = family(traces, requests, seed)
    virtual = [(t, {p: serve_virtual(p, t) for p in POLICIES}) for t in generated]
    sampled = sample(generated, real_traces)
    real = [(t, one) for t in sampled for one in serve_real(t, rounds, solo_repeats)]
    return {
        "benchmark": "slo-family",
        "traces": len(generated),
        "requests_per_trace": requests,
        "virtual": {
            "by_scale": summary(virtual),
            "by_trace": per_trace(virtual),
            "short_of_targets": {
                t.name: {
                    "attainment": one.attainment,
                    "lateness": one.lateness,
                    "met_slo_edf_best_other": [one.slo_met, one.edf_met, one.best_other_met],
                }
                for t, s in virtual
                if not ((one := targets(s)).attainment and one.lateness)
            },
        },
        "real": {
            "rounds": rounds,
            "by_scale": summary(real),
            "by_trace": per_trace(real),
        },
    }
