"""Prometheus metrics of an engine, fed by its trace events; mountable without HTTP.

:class:`EngineMetrics` subscribes to ``engine.machine`` and turns lifecycle,
wave and runner events into counters and histograms in its own
:class:`~prometheus_client.CollectorRegistry`. Gauges that the engine already
knows (queue length, health, the online auditor's violations) are read when
the registry is scraped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.errors import DiffusionRuntimeError
from diffusion_runtime.fsm import ADMIT, LifecycleEvent, RequestStatus, Trigger
from diffusion_runtime.fsm.events import (
    AdapterEvent,
    EngineEvent,
    RunnerEvent,
    TraceEvent,
    WaveEvent,
)

#: Seconds: from a fast step of a small model to minutes of a large one.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

TERMINAL_LABELS = {
    RequestStatus.FINISHED_COMPLETED: "completed",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_ERROR: "error",
}


class EngineMetrics:
    """An engine's metrics in ``registry`` (a fresh one by default).

    Call :meth:`attach` to start counting and :meth:`detach` to stop. The
    subscriber runs on the engine's threads, so it only updates thread-safe
    metrics and a few small tables under a lock. Requests admitted before
    :meth:`attach` are counted when they end but have no latency.
    """

    def __init__(self, engine: DiffusionEngine, registry: CollectorRegistry | None = None) -> None:
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "diffusion_requests",
            "Requests that reached a terminal state, by status",
            ["status"],
            registry=r,
        )
        for label in TERMINAL_LABELS.values():
            self.requests.labels(label)
        self.admitted = Counter("diffusion_requests_admitted", "Requests admitted", registry=r)
        self.running = Gauge("diffusion_requests_running", "Requests running now", registry=r)
        self.preemptions = Counter(
            "diffusion_preemptions", "Running requests preempted", registry=r
        )
        self.waves = Counter("diffusion_waves", "Waves (or steps) the workers ran", registry=r)
        self.steps = Counter(
            "diffusion_denoise_steps",
            "Denoising steps run, one per request per step (request mode: counted at "
            "completion by the server)",
            registry=r,
        )
        self.cached_steps = Counter(
            "diffusion_cached_steps",
            "Denoising steps that reused a cached model output instead of running the "
            "model (a step cache, docs/caching.md)",
            registry=r,
        )
        self.batch_size = Histogram(
            "diffusion_batch_size", "Requests per wave", buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_latency = Histogram(
            "diffusion_queue_latency_seconds",
            "Admission to first scheduled",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.execution_latency = Histogram(
            "diffusion_execution_latency_seconds",
            "First scheduled to completed (completed requests)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "diffusion_e2e_latency_seconds",
            "Admission to completed (completed requests)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_deaths = Counter(
            "diffusion_engine_deaths",
            "Engine deaths (a worker died, a device fault or a loop crash); see the log for why",
            registry=r,
        )
        self.adapter_requests = Counter(
            "diffusion_lora_requests",
            "Requests admitted with a LoRA adapter, by adapter id",
            ["adapter_id"],
            registry=r,
        )
        self.adapter_evictions = Counter(
            "diffusion_lora_evictions",
            "LoRA adapters evicted from host memory to load another",
            registry=r,
        )
        r.register(_EngineStateCollector(engine))
        self._lock = threading.Lock()
        self._admitted_at: dict[str, float] = {}
        self._scheduled_at: dict[str, float] = {}
        self._running: set[str] = set()
        self._attached = False

    def attach(self) -> None:
        """Subscribe to the engine's events (once)."""
        if not self._attached:
            self.engine.machine.subscribe(self.observe)
            self._attached = True

    def detach(self) -> None:
        """Stop counting; the registry keeps the values reached."""
        if self._attached:
            self.engine.machine.unsubscribe(self.observe)
            self._attached = False
            with self._lock:
                self._admitted_at.clear()
                self._scheduled_at.clear()
                self._running.clear()

    def observe(self, event: TraceEvent) -> None:
        """The engine's event subscriber."""
        if isinstance(event, LifecycleEvent):
            if not event.rejected:
                self._lifecycle(event)
        elif isinstance(event, WaveEvent):
            scheduled = len(event.new_ids) + len(event.cached_ids)
            if scheduled:
                self.waves.inc()
                self.batch_size.observe(scheduled)
        elif isinstance(event, RunnerEvent):
            if event.progressed:
                self.steps.inc(len(event.progressed))
            cached = sum(count for _, count in event.cached_steps)
            if cached:
                self.cached_steps.inc(cached)
        elif isinstance(event, EngineEvent) and event.state == "dead":
            self.engine_deaths.inc()
        elif isinstance(event, AdapterEvent):
            if event.action == "used":
                self.adapter_requests.labels(str(event.adapter_id)).inc()
            elif event.action == "evicted":
                self.adapter_evictions.inc()

    def count_steps(self, steps: int) -> None:
        """Count ``steps`` denoising steps the engine ran without reporting them
        (a request-mode forward runs all of a request's steps at once)."""
        self.steps.inc(steps)

    def _lifecycle(self, event: LifecycleEvent) -> None:
        rid = event.request_id
        if event.trigger == ADMIT:
            self.admitted.inc()
            with self._lock:
                self._admitted_at[rid] = event.time
            return
        with self._lock:  # a set, not inc/dec: a request running before attach is no -1
            if event.source is RequestStatus.RUNNING:
                self._running.discard(rid)
            if event.dest is RequestStatus.RUNNING:
                self._running.add(rid)
            self.running.set(len(self._running))
        if event.dest is RequestStatus.RUNNING:
            with self._lock:
                first = rid not in self._scheduled_at
                self._scheduled_at.setdefault(rid, event.time)
                admitted_at = self._admitted_at.get(rid)
            if first and admitted_at is not None:
                self.queue_latency.observe(event.time - admitted_at)
        elif event.trigger == Trigger.PREEMPT.value:
            self.preemptions.inc()
        label = TERMINAL_LABELS.get(event.dest)
        if label is None:
            return
        self.requests.labels(label).inc()
        with self._lock:
            admitted_at = self._admitted_at.pop(rid, None)
            scheduled_at = self._scheduled_at.pop(rid, None)
        if event.dest is RequestStatus.FINISHED_COMPLETED:
            if scheduled_at is not None:
                self.execution_latency.observe(event.time - scheduled_at)
            if admitted_at is not None:
                self.e2e_latency.observe(event.time - admitted_at)


class _EngineStateCollector(Collector):
    """What the engine knows right now, read at scrape time."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        yield GaugeMetricFamily(
            "diffusion_requests_waiting",
            "Requests waiting to be scheduled",
            value=engine.queue_length,
        )
        yield GaugeMetricFamily(
            "diffusion_engine_healthy",
            "1 while the engine serves, 0 once closed or dead",
            value=_healthy(engine),
        )
        violations = CounterMetricFamily(
            "diffusion_invariant_violations",
            "Invariant violations found by the online auditor (EngineConfig.audit)",
            labels=["invariant"],
        )
        if engine.auditor is not None:
            by_invariant: dict[str, int] = {}
            for violation in list(engine.auditor.violations):
                by_invariant[violation.invariant] = by_invariant.get(violation.invariant, 0) + 1
            for invariant, count in sorted(by_invariant.items()):
                violations.add_metric([invariant], count)
        yield violations


def _healthy(engine: DiffusionEngine) -> int:
    try:
        engine.check_health()
    except DiffusionRuntimeError:
        return 0
    return 1
