"""Engine configuration."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from diffusion_runtime.cache_settings import check_backend, check_cache_dict
from diffusion_runtime.validation import (
    fail,
    finite_in_range,
    int_in_range,
    is_bool,
    one_of,
    str_keyed_dict,
)

EXECUTION_MODES = ("request", "step")
BUILTIN_BACKENDS = ("uni", "mp", "ray")
AUDIT_MODES = ("off", "report", "raise")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
BUILTIN_POLICIES = ("fifo", "priority", "edf", "slo")
DEADLINE_MISS_ACTIONS = ("run_late", "drop")
#: The parallel degrees, as fields of :class:`EngineConfig` (``docs/parallelism.md``).
PARALLEL_DEGREES = ("cfg_parallel_size", "ulysses_degree", "ring_degree")


def default_device() -> str:
    """CUDA when a device is present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_str(value: Any) -> Any:
    if value is None:
        return default_device()
    return str(value) if isinstance(value, torch.device) else value


def _is_device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    rule = "must name a torch device such as 'cpu' or 'cuda:0'"
    if not isinstance(value, str):
        fail(instance, attribute.name, rule, value)
    try:
        torch.device(value)
    except Exception:
        fail(instance, attribute.name, rule, value)


def _world_size_default(config: Any) -> Any:
    """``num_workers``' default: the product of the degrees (1 while one is not an
    integer: its own validator, which runs first, refuses it)."""
    degrees = [getattr(config, name) for name in PARALLEL_DEGREES]
    if all(isinstance(d, int) and not isinstance(d, bool) for d in degrees):
        return math.prod(degrees)
    return 1


def _is_pipeline_spec(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    from diffusion_runtime.pipelines.registry import is_known_pipeline_name

    if callable(value) or (isinstance(value, str) and is_known_pipeline_name(value)):
        return
    fail(
        instance,
        attribute.name,
        "must be a registered pipeline name, a 'module:attr' import path or a factory",
        value,
    )


#: What an executor class has (checked by shape: the executors sit above this module).
_EXECUTOR_METHODS = ("execute", "collective_rpc", "shutdown", "validate_request")


def _is_backend(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None or (
        isinstance(value, type)
        and all(callable(getattr(value, m, None)) for m in _EXECUTOR_METHODS)
    ):
        return
    if isinstance(value, str) and (value in BUILTIN_BACKENDS or ":" in value or "." in value):
        return
    fail(
        instance,
        attribute.name,
        "must be 'uni', 'mp', 'ray', a DiffusionExecutor subclass or an import path",
        value,
    )


def _is_policy(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    # Checked by shape: the policies sit above this module.
    if isinstance(value, type) and callable(getattr(value, "rank", None)):
        return
    if isinstance(value, str) and (value in BUILTIN_POLICIES or ":" in value):
        return
    fail(
        instance,
        attribute.name,
        "must be 'fifo', 'priority', 'edf', 'slo', a SchedulingPolicy subclass "
        "or a 'module:attr' import path",
        value,
    )


def _is_optional_path(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value and "\0" not in value):
        fail(instance, attribute.name, "must be a non-empty file path or None", value)


def _copy_dict(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else value


def _list_to_tuple(value: Any) -> Any:
    """A list becomes a tuple; anything else is left for the validator to judge."""
    return tuple(value) if isinstance(value, list) else value


def _is_optional_address(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value.strip()):
        fail(instance, attribute.name, "must be a Ray address ('auto', 'host:port') or None", value)


def _is_extension_list(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(item, (str, type)) for item in value):
        fail(
            instance,
            attribute.name,
            "must be a list or tuple of classes or 'module:attr' import paths",
            value,
        )


def _is_cache_backend(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_backend(type(instance).__name__, attribute.name, value, optional=True)


def _is_cache_config(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_cache_dict(type(instance).__name__, attribute.name, value, backend_key=False)


@attrs.frozen(slots=True)
class EngineConfig:
    """Everything an engine needs to start. Every field is validated on construction.

    ``pipeline`` is a registered name (``"digits"``), a ``"module:attr"`` import
    path, or a factory called as ``factory(device=..., **pipeline_kwargs)``.
    ``executor_backend=None`` picks ``"uni"`` for one worker and ``"mp"`` for
    more. ``request_batch_max_wait_ms > 0`` lets the request scheduler wait that
    long for a fuller wave. ``max_waiting_requests=None`` leaves the queue unbounded.
    ``streaming_output=True`` turns on step mode and sends a preview every
    ``preview_interval`` steps. ``init_distributed`` joins the workers (mp
    processes or Ray actors) in a ``torch.distributed`` group;
    ``worker_start_timeout_s`` bounds their start-up and ``shutdown_grace_s``
    how long they get to stop before being killed.
    ``cfg_parallel_size`` (1 or 2), ``ulysses_degree`` and ``ring_degree``
    split each forward between ranks that share one model
    (``docs/parallelism.md``); their product is the world size, which
    ``num_workers`` defaults to and must then equal, and a degree above 1
    joins the workers in a group as ``init_distributed`` does.
    ``worker_liveness_timeout_s`` is how long a worker process may go without a
    heartbeat before it counts as hung (stopped, deadlocked) and the executor fails.
    ``intra_op_threads`` is torch's thread count in the thread that runs the
    pipeline (default: the count torch has where the worker is built); small
    models on few cores often run faster with 1. ``trace_path`` writes every
    event as JSON lines; ``audit`` checks the
    invariants online and, on a violation, logs it (``"report"``) or fails the
    engine (``"raise"``).

    ``scheduling_policy`` orders the waiting requests (``docs/schedulers.md``):
    ``"fifo"`` (arrival order, the default), ``"priority"``, ``"edf"``, ``"slo"``,
    a ``SchedulingPolicy`` subclass or a ``"module:attr"`` path to one. A request
    that has waited ``scheduling_aging_s`` goes before every younger one and is
    no longer preempted (the bound against starvation). ``deadline_miss="drop"``
    aborts a request whose deadline passes while it waits (reason ``"deadline"``);
    ``"run_late"`` runs it anyway. ``preempted_offload_bytes`` > 0 (step mode)
    lets each worker keep the step state of requests a step does not run
    (preempted ones) in host memory, up to that many bytes, and bring it back
    before they resume; 0 (the default) keeps every state on the device
    (``docs/gpu.md``).

    The ``ray_*`` fields apply to ``executor_backend="ray"`` (see
    ``docs/distributed.md``): ``ray_address`` names the cluster to join (None:
    the Ray of this process if initialised, else a local one started and later
    stopped by the executor); each worker is one actor holding
    ``ray_cpus_per_worker`` CPUs (and one GPU when ``device`` is CUDA) in a
    placement group bundle, placed by ``ray_placement_strategy``; a worker that
    leaves a liveness ping unanswered for ``ray_liveness_timeout_s`` is taken
    for dead.

    ``overlap_outputs`` (default on) lets a CUDA worker return a wave as soon
    as its work is enqueued and copy its images to pinned host memory on a
    side stream, so the next step is scheduled while the copy runs; outputs
    are delivered once their copy is done (see ``docs/gpu.md``). Off, every
    wave waits for its copy. It changes nothing on the CPU.

    ``max_loras`` > 0 turns on LoRA adapters (``docs/lora.md``): at most that
    many distinct adapters run in one step or wave, from device slots; up to
    ``max_cpu_loras`` (default ``max_loras``) stay loaded in host memory; an
    adapter's rank is at most ``max_lora_rank``.
    ``profile_dir`` is where ``start_profile``/``stop_profile`` write one
    ``torch.profiler`` trace per worker (``docs/operations.md``); ``None`` (the
    default) refuses profiling, so no caller can make the engine fill a disk.
    ``max_trajectory_steps`` bounds the memory of one returned trajectory: a
    request with ``return_trajectory`` and more steps is refused at admission
    (``docs/outputs.md``).
    ``cache_backend`` turns on a step cache for every request (``"tea_cache"``,
    ``"first_block"``; the pipeline must serve it, checked at start-up) with
    the settings in ``cache_config`` (``rel_l1_thresh``, ``warmup_steps``,
    ``max_consecutive_skips``); a request may opt out or override them with
    ``SamplingParams.cache`` (``docs/caching.md``).
    """

    pipeline: str | Callable[..., Any] = attrs.field(default="digits", validator=_is_pipeline_spec)
    pipeline_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=str_keyed_dict)
    device: str = attrs.field(default=None, converter=_device_str, validator=_is_device)
    max_num_seqs: int = attrs.field(default=8, validator=int_in_range(1, 65_536))
    max_waiting_requests: int | None = attrs.field(
        default=None, validator=int_in_range(1, 2**40, optional=True)
    )
    execution_mode: str = attrs.field(default="request", validator=one_of(*EXECUTION_MODES))
    executor_backend: str | type | None = attrs.field(default=None, validator=_is_backend)
    # The degrees come before num_workers: its default is their product.
    cfg_parallel_size: int = attrs.field(default=1, validator=int_in_range(1, 2))
    ulysses_degree: int = attrs.field(default=1, validator=int_in_range(1, 1024))
    ring_degree: int = attrs.field(default=1, validator=int_in_range(1, 1024))
    num_workers: int = attrs.field(
        default=attrs.Factory(_world_size_default, takes_self=True),
        validator=int_in_range(1, 1024),
    )
    request_batch_max_wait_ms: float = attrs.field(
        default=0.0, validator=finite_in_range(0.0, 60_000.0)
    )
    warmup: bool = attrs.field(default=True, validator=is_bool)
    worker_extensions: tuple[str | type, ...] = attrs.field(
        default=(), converter=_list_to_tuple, validator=_is_extension_list
    )
    streaming_output: bool = attrs.field(default=False, validator=is_bool)
    preview_interval: int = attrs.field(default=5, validator=int_in_range(1, 10_000))
    init_distributed: bool = attrs.field(default=False, validator=is_bool)
    worker_start_timeout_s: float = attrs.field(
        default=300.0, validator=finite_in_range(0.1, 86_400.0)
    )
    shutdown_grace_s: float = attrs.field(default=5.0, validator=finite_in_range(0.0, 3_600.0))
    worker_liveness_timeout_s: float = attrs.field(
        default=5.0, validator=finite_in_range(0.1, 3_600.0)
    )
    overlap_outputs: bool = attrs.field(default=True, validator=is_bool)
    intra_op_threads: int | None = attrs.field(
        default=None, validator=int_in_range(1, 1024, optional=True)
    )
    trace_path: str | None = attrs.field(default=None, validator=_is_optional_path)
    audit: str = attrs.field(default="off", validator=one_of(*AUDIT_MODES))
    scheduling_policy: str | type = attrs.field(default="fifo", validator=_is_policy)
    scheduling_aging_s: float = attrs.field(
        default=10.0, validator=finite_in_range(0.001, 86_400.0)
    )
    deadline_miss: str = attrs.field(default="run_late", validator=one_of(*DEADLINE_MISS_ACTIONS))
    preempted_offload_bytes: int = attrs.field(default=0, validator=int_in_range(0, 2**50))
    ray_address: str | None = attrs.field(default=None, validator=_is_optional_address)
    ray_placement_strategy: str = attrs.field(
        default="PACK", validator=one_of(*RAY_PLACEMENT_STRATEGIES)
    )
    ray_cpus_per_worker: float = attrs.field(default=1.0, validator=finite_in_range(0.01, 1024.0))
    ray_liveness_timeout_s: float = attrs.field(
        default=10.0, validator=finite_in_range(0.1, 3_600.0)
    )
    max_loras: int = attrs.field(default=0, validator=int_in_range(0, 1024))
    max_cpu_loras: int | None = attrs.field(
        default=None, validator=int_in_range(1, 65_536, optional=True)
    )
    max_lora_rank: int = attrs.field(default=16, validator=int_in_range(1, 1024))
    profile_dir: str | None = attrs.field(default=None, validator=_is_optional_path)
    max_trajectory_steps: int = attrs.field(default=1000, validator=int_in_range(1, 100_000))
    cache_backend: str | None = attrs.field(default=None, validator=_is_cache_backend)
    cache_config: dict[str, Any] = attrs.field(
        factory=dict, converter=_copy_dict, validator=_is_cache_config, hash=False
    )

    def __attrs_post_init__(self) -> None:
        self._check_parallel_degrees()
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            fail(
                self,
                "max_cpu_loras",
                f"must be at least max_loras ({self.max_loras})",
                self.max_cpu_loras,
            )

    def _check_parallel_degrees(self) -> None:
        if self.world_size == 1:
            return
        if self.num_workers != self.world_size:
            rule = (
                f"must equal cfg_parallel_size * ulysses_degree * ring_degree "
                f"({self.world_size}) when a degree is above 1: every rank shares one model"
            )
            fail(self, "num_workers", rule, self.num_workers)
        if self.executor_backend == "uni":
            rule = (
                "must be 'mp' or 'ray' when a parallel degree is above 1: "
                "the ranks that share one model run in separate processes"
            )
            fail(self, "executor_backend", rule, self.executor_backend)

    @property
    def world_size(self) -> int:
        """The ranks that share one model: the product of the parallel degrees."""
        return self.cfg_parallel_size * self.ulysses_degree * self.ring_degree

    @property
    def joins_process_group(self) -> bool:
        """Whether the workers join one ``torch.distributed`` group: asked for, or
        needed by a parallel degree above 1."""
        return self.init_distributed or self.world_size > 1

    @property
    def lora_capacity(self) -> int:
        """How many adapters the workers keep in host memory (``max_cpu_loras``,
        default ``max_loras``)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def resolved_mode(self) -> str:
        """Streaming needs step boundaries, so it implies step mode."""
        return "step" if self.streaming_output else self.execution_mode

    @property
    def resolved_backend(self) -> str | type:
        if self.executor_backend is not None:
            return self.executor_backend
        return "uni" if self.num_workers == 1 else "mp"
