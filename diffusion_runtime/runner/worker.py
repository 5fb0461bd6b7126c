"""Worker: owns a device, the pipeline on it and the runner; the target of every executor call."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.contracts import RunnerOutput, SchedulerOutput
from diffusion_runtime.errors import (
    InvalidFieldError,
    LoRAError,
    PipelineContractError,
    RPCError,
    SleepStateError,
)
from diffusion_runtime.lora.layers import AdapterSlots
from diffusion_runtime.lora.store import AdapterStore, WorkerAdapters
from diffusion_runtime.lora.weights import AdapterFileError
from diffusion_runtime.lora_request import LoRARequest
from diffusion_runtime.pipelines.registry import build_pipeline, import_object
from diffusion_runtime.runner.model_runner import ModelRunner
from diffusion_runtime.runner.parallel import enable_parallel
from diffusion_runtime.runner.profiling import WorkerProfiler
from diffusion_runtime.runner.sleep import WorkerSleep
from diffusion_runtime.runner.weights import device_weight_bytes
from diffusion_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of worker ``rank``: ``cuda:rank`` for ``"cuda"`` without an index.

    Raises :class:`InvalidFieldError` for a CUDA device this process cannot see.
    """
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise InvalidFieldError(
            "EngineConfig",
            "device",
            "names a CUDA device, but no CUDA device is available",
            config.device,
        )
    index = rank if device.index is None else device.index
    visible = torch.cuda.device_count()
    if index >= visible:
        raise InvalidFieldError(
            "EngineConfig",
            "device",
            f"needs cuda:{index}, but {visible} CUDA device(s) are visible",
            config.device,
        )
    return torch.device("cuda", index)


def extension_method_names(cls: type) -> list[str]:
    """The RPC methods a worker extension class adds: its public functions.

    Only methods defined on the class count: attributes that happen to be
    callable (a module, a stored function) never become RPC methods.
    """
    return [
        name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")
    ]


class Worker:
    """One device's worth of execution.

    Executors call its methods by name through :meth:`call`, which accepts only
    the methods in :attr:`RPC_METHODS` and those added by worker extensions.
    An extension is a class built as ``Extension(worker)``; each of its public
    methods becomes callable by name. Extensions add methods; they never
    become a second scheduler or lifecycle.
    """

    RPC_METHODS = frozenset(
        {
            "execute_model",
            "cached_request_ids",
            "offloaded_request_ids",
            "release_requests",
            "check_health",
            "device_name",
            "warmup_request",
            "validate_request",
            "stage_lora",
            "commit_lora",
            "abort_lora",
            "remove_lora",
            "list_loras",
            "staged_lora_ids",
            "sleep_device",
            "wake_device",
            "device_sleeping",
            "device_weight_bytes",
            "start_profile",
            "stop_profile",
        }
    )
    #: Methods only the executor may call: they run or drop scheduler decisions, or
    #: (the adapter ones) change adapters behind the core's table; callers use the
    #: fronts' ``add_lora``/``remove_lora`` instead.
    EXECUTION_METHODS = frozenset(
        {
            "execute_model",
            "release_requests",
            "stage_lora",
            "commit_lora",
            "abort_lora",
            "remove_lora",
        }
    )
    #: Methods only the engine core may call: it must know the workers sleep.
    #: (Not named ``sleep``: a user's extension may well have a method of that name.)
    SLEEP_METHODS = frozenset({"sleep_device", "wake_device"})
    #: Methods no caller reaches through ``collective_rpc`` or the stage.
    RESERVED_METHODS = EXECUTION_METHODS | SLEEP_METHODS

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = worker_device(config, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.intra_op_threads = config.intra_op_threads or torch.get_num_threads()
        self.bind_thread()
        self.pipeline = build_pipeline(config.pipeline, self.device, config.pipeline_kwargs)
        self._methods: dict[str, Callable[..., Any]] = {}
        try:
            enable_parallel(self.pipeline, config, rank)
            self.runner = ModelRunner(
                self.pipeline,
                self.device,
                step_mode=config.resolved_mode == "step",
                preview_interval=config.preview_interval if config.streaming_output else 0,
                overlap_outputs=config.overlap_outputs,
                offload_budget_bytes=config.preempted_offload_bytes,
                cache_backend=config.cache_backend,
                cache_config=config.cache_config,
            )
            self.adapters = self._adapter_store()
            self.sleeper = WorkerSleep(self.pipeline, self.runner, self.device)
            self.profiler = WorkerProfiler(config.profile_dir, rank, self.device)
            self._methods.update((name, getattr(self, name)) for name in self.RPC_METHODS)
            for extension in config.worker_extensions:
                self._add_extension(extension)
        except BaseException:
            self._close_pipeline()
            raise

    def bind_thread(self) -> None:
        """Give the calling thread the worker's torch thread count.

        torch's intra-op thread count is per thread: a thread that did not set
        it (such as the engine's loop thread) runs with a default that was
        measured up to 1.8x slower here.
        """
        torch.set_num_threads(self.intra_op_threads)

    # -- dispatch ----------------------------------------------------------------------

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run an allowed method by name; refuse anything else."""
        fn = self._methods.get(method)
        if fn is None:
            raise RPCError(
                f"method {method!r} is not callable on workers; allowed: {sorted(self._methods)}"
            )
        return fn(*args, **kwargs)

    @property
    def rpc_methods(self) -> frozenset[str]:
        return frozenset(self._methods)

    def _add_extension(self, extension: str | type) -> None:
        cls = import_object(extension) if isinstance(extension, str) else extension
        instance = cls(self)
        for name in extension_method_names(cls):
            if name in self._methods:
                raise ValueError(f"worker extension {cls.__name__} redefines method {name!r}")
            self._methods[name] = getattr(instance, name)

    # -- built-in methods ----------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self.sleeper.is_sleeping and scheduler_output.has_work:
            raise SleepStateError(f"worker {self.rank} is asleep: it runs no wave")
        with self.profiler.wave(scheduler_output.wave_id):
            if self.adapters is not None:
                self.adapters.activate(self._adapters_of(scheduler_output))
            return self.runner.execute_model(scheduler_output)

    def cached_request_ids(self) -> list[str]:
        return self.runner.cached_request_ids()

    def offloaded_request_ids(self) -> list[str]:
        return self.runner.offloaded_request_ids()

    def release_requests(self, request_ids: list[str]) -> None:
        self.runner.release_requests(request_ids)

    def check_health(self) -> bool:
        return True

    def device_name(self) -> str:
        return str(self.device)

    def warmup_request(self) -> tuple[Any, SamplingParams] | None:
        fn = getattr(self.pipeline, "warmup_request", None)
        return None if fn is None else fn()

    def validate_request(self, prompt: Any, params: SamplingParams) -> None:
        self.runner.check_output_options(params)
        self.runner.check_custom_schedule(params)
        self.runner.check_step_cache(params)
        if params.lora is not None:
            self._check_adapter(params.lora)
        fn = getattr(self.pipeline, "validate_request", None)
        if fn is not None:
            fn(prompt, params)

    def _check_adapter(self, lora: LoRARequest) -> None:
        """Refuse, on ``SamplingParams.lora``, an adapter not loaded whose file the
        pipeline's adapters cannot take (only they know their file format)."""
        adapters = self.adapters
        if adapters is None or lora.adapter_id in adapters.loaded_ids():
            return
        try:
            adapters.check_file(lora.path)
        except AdapterFileError as exc:
            rule = f"names adapter {lora.adapter_id}, which is not loaded and cannot be: {exc}"
            raise InvalidFieldError("SamplingParams", "lora", rule, lora) from exc

    def sleep_device(self, level: int) -> None:
        """Free the device's memory (see :class:`WorkerSleep`); only the core calls this."""
        self.sleeper.sleep(level)

    def wake_device(self) -> None:
        """Restore what :meth:`sleep_device` freed, exactly."""
        self.sleeper.wake_up()

    def device_sleeping(self) -> bool:
        return self.sleeper.is_sleeping

    def device_weight_bytes(self) -> int:
        """Bytes of weight storage the pipeline holds on this worker's device."""
        return device_weight_bytes(self.pipeline, self.device)

    def start_profile(self, prefix: str) -> str:
        """Start ``torch.profiler``; returns where :meth:`stop_profile` writes the trace."""
        return self.profiler.start(prefix)

    def stop_profile(self) -> str:
        """Stop ``torch.profiler`` and write this worker's trace; returns its path."""
        return self.profiler.stop()

    def shutdown(self) -> None:
        """Release the pipeline and, on CUDA, the cached device memory."""
        self._methods.clear()
        self.profiler.close()
        self.runner.close()
        self._close_pipeline()
        self.adapters = None
        del self.pipeline, self.runner, self.sleeper  # the sleeper holds host copies
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _close_pipeline(self) -> None:
        close = getattr(self.pipeline, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.exception("pipeline close() failed on worker %d", self.rank)

    # -- adapters (two-phase: see diffusion_runtime.lora.store) ---------------------------

    def stage_lora(self, request: LoRARequest) -> None:
        self._store().stage(request)

    def commit_lora(self, adapter_id: int, evict: list[int]) -> None:
        self._store().commit(adapter_id, evict)

    def abort_lora(self, adapter_id: int) -> None:
        self._store().abort(adapter_id)

    def remove_lora(self, adapter_id: int) -> bool:
        return self._store().remove(adapter_id)

    def list_loras(self) -> list[int]:
        return [] if self.adapters is None else self.adapters.loaded_ids()

    def staged_lora_ids(self) -> list[int]:
        return [] if self.adapters is None else self.adapters.staged_ids()

    def _adapters_of(self, scheduler_output: SchedulerOutput) -> set[int]:
        """The adapters of the requests an output runs (new ones and cached ones)."""
        params = [data.params for data in scheduler_output.scheduled_new_reqs]
        states = self.runner.states
        params += [
            states[rid].request.params
            for rid in scheduler_output.scheduled_cached_ids
            if rid in states
        ]
        return {p.lora.adapter_id for p in params if p.lora is not None}

    def _adapter_store(self) -> WorkerAdapters | None:
        """The pipeline's adapters: ``enable_lora`` returns :class:`AdapterSlots` (kept
        by an :class:`AdapterStore`) or its own :class:`WorkerAdapters`."""
        if not self.config.max_loras:
            return None
        enable = getattr(self.pipeline, "enable_lora", None)
        if enable is None:
            raise PipelineContractError(
                f"EngineConfig.max_loras needs a pipeline with enable_lora; "
                f"{type(self.pipeline).__name__} has none"
            )
        enabled = enable(self.config.max_loras, self.config.max_lora_rank)
        if isinstance(enabled, AdapterSlots):
            return AdapterStore(enabled)
        if not isinstance(enabled, WorkerAdapters):
            raise PipelineContractError(
                f"{type(self.pipeline).__name__}.enable_lora returned "
                f"{type(enabled).__name__}, neither AdapterSlots nor WorkerAdapters"
            )
        return enabled

    def _store(self) -> WorkerAdapters:
        if self.adapters is None:
            raise LoRAError("adapters are off: EngineConfig.max_loras is 0")
        return self.adapters
