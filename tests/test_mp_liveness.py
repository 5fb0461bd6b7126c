"""Liveness of mp workers and enforced RPC limits: a stopped worker fails the
engine within the bound, no write blocks for good, and every RPC argument is
checked before anything is sent.

Classes that workers must build live at module level so spawned processes can
import them from this file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import child_pids, engine_threads, wait_for
from executor_helpers import run_in_thread

from diffusion_runtime import (
    DiffusionEngine,
    EngineConfig,
    EngineDeadError,
    InvalidFieldError,
    RPCError,
    SamplingParams,
)
from diffusion_runtime.executor.mp import MultiprocExecutor
from diffusion_runtime.executor.mp.pipe_writer import PipeWriter
from diffusion_runtime.executor.mp.wakeup import Wakeup
from diffusion_runtime.executor.uni import UniProcExecutor

LIVENESS_S = 1.0
GRACE_S = 0.5
#: What a loaded 2-core machine may add to a bound (scheduling, reaping a process).
#: The bugs these tests catch miss a bound by far more: a caller blocked until its
#: own 30 s timeout, a close that waits out the 60 s default liveness.
SLACK_S = 4.0


class Pid:
    """A worker extension: the worker's process id."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value: Any) -> Any:
        return value

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def mp_config(**overrides: Any) -> EngineConfig:
    overrides.setdefault("pipeline", "testing-noise")
    overrides.setdefault("device", "cpu")
    overrides.setdefault("executor_backend", "mp")
    overrides.setdefault("worker_start_timeout_s", 60.0)
    overrides.setdefault("worker_extensions", (Pid,))
    overrides.setdefault("worker_liveness_timeout_s", LIVENESS_S)
    overrides.setdefault("shutdown_grace_s", GRACE_S)
    return EngineConfig(**overrides)


def process_exists(pid: int) -> bool:
    """Whether ``pid`` is running or waiting to be reaped."""
    return os.path.exists(f"/proc/{pid}")


@pytest.fixture(autouse=True, scope="module")
def nothing_left_behind() -> Iterator[None]:
    """After this module (one executor is shared by the RPC tests): nothing left running."""
    yield
    assert wait_for(lambda: not multiprocessing.active_children() and not child_pids())
    assert not [t.name for t in threading.enumerate() if t.name.startswith("diffusion-")]


@pytest.fixture
def stopped_pids() -> Iterator[list[int]]:
    """Processes a test stopped: continued and killed at teardown, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


# -- liveness ----------------------------------------------------------------------------


def test_a_stopped_worker_fails_every_caller_within_the_bound_and_close_returns(
    stopped_pids: list[int],
) -> None:
    config = mp_config(num_workers=2, execution_mode="step")
    engine = DiffusionEngine.make_engine(config)
    try:
        pids = engine.collective_rpc("pid")
        long_request = SamplingParams(num_inference_steps=10_000, seed=1, height=16, width=16)
        blocked = run_in_thread(lambda: engine.generate(["long"], long_request))
        assert wait_for(lambda: engine.snapshot().running_ids != frozenset())

        os.kill(pids[1], signal.SIGSTOP)
        stopped_pids.append(pids[1])
        stopped = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker 1 \(pid \d+\) stopped answering"):
            blocked.result(30)
        detected = time.monotonic() - stopped
        assert detected <= LIVENESS_S + SLACK_S
        with pytest.raises(EngineDeadError, match="stopped answering"):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.generate(["after"], SamplingParams(num_inference_steps=2))
    finally:
        started = time.monotonic()
        engine.close()
    assert time.monotonic() - started <= GRACE_S + SLACK_S
    assert engine_threads() == []
    assert not [pid for pid in pids if process_exists(pid)]


def test_close_returns_while_a_worker_is_stopped_between_waves(stopped_pids: list[int]) -> None:
    engine = DiffusionEngine.make_engine(mp_config(num_workers=2, worker_liveness_timeout_s=60.0))
    pids = engine.collective_rpc("pid")
    os.kill(pids[0], signal.SIGSTOP)
    stopped_pids.append(pids[0])
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started <= GRACE_S + SLACK_S
    assert not [pid for pid in pids if process_exists(pid)]


def test_a_full_pipe_blocks_a_send_only_until_writes_are_abandoned() -> None:
    reader, writer_end = multiprocessing.Pipe(duplex=False)
    abandon = Wakeup()
    writer = PipeWriter(writer_end, 0, abandon)
    try:
        blocked = run_in_thread(lambda: writer.send(b"x" * (1 << 22)))  # the reader is not reading
        with pytest.raises(concurrent.futures.TimeoutError):
            blocked.result(0.2)
        abandon.set()
        with pytest.raises(EngineDeadError, match="abandoned"):
            blocked.result(5)
        with pytest.raises(EngineDeadError, match="mid-frame"):
            writer.send(b"more")
    finally:
        writer.close()
        reader.close()
        abandon.close()


@pytest.mark.parametrize("size", [0, 5, 16_384, 16_385, 1 << 20])
def test_frames_read_back_with_recv_bytes(size: int) -> None:
    reader, writer_end = multiprocessing.Pipe(duplex=False)
    abandon = Wakeup()
    writer = PipeWriter(writer_end, 0, abandon)
    payload = os.urandom(size)
    try:
        received = run_in_thread(lambda: (reader.recv_bytes(), reader.recv_bytes()))
        writer.send(payload)
        writer.send(b"next")
        assert received.result(5) == (payload, b"next")
    finally:
        writer.close()
        reader.close()
        abandon.close()


def test_a_send_to_a_dead_reader_fails_at_once() -> None:
    reader, writer_end = multiprocessing.Pipe(duplex=False)
    abandon = Wakeup()
    writer = PipeWriter(writer_end, 3, abandon)
    reader.close()
    try:
        with pytest.raises(EngineDeadError, match="worker 3 cannot be reached"):
            writer.send(b"x")
    finally:
        writer.close()
        abandon.close()


# -- RPC arguments and timeouts ----------------------------------------------------------


@pytest.fixture(scope="module")
def mp_executor() -> Iterator[MultiprocExecutor]:
    executor = MultiprocExecutor(mp_config(num_workers=2))
    yield executor
    executor.shutdown()


def test_mp_rpc_timeouts_are_enforced_and_late_replies_dropped(
    mp_executor: MultiprocExecutor,
) -> None:
    started = time.monotonic()
    with pytest.raises(RPCError, match=r"timed out after 0\.2 s"):
        mp_executor.collective_rpc("sleep", (0.6,), timeout=0.2)
    assert time.monotonic() - started < 0.6
    # The late replies (0.6) find no caller; the next call gets its own.
    assert mp_executor.collective_rpc("echo", ("mine",), timeout=math.inf) == ["mine", "mine"]
    assert mp_executor.collective_rpc("echo", (1,), timeout=10**400, unique_reply_rank=1) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": math.nan}, InvalidFieldError, r"collective_rpc\.timeout"),
        ({"timeout": -1.0}, InvalidFieldError, r"collective_rpc\.timeout"),
        ({"timeout": "1"}, InvalidFieldError, r"collective_rpc\.timeout"),
        ({"unique_reply_rank": True}, RPCError, "unique_reply_rank True does not exist"),
        ({"unique_reply_rank": 2}, RPCError, "unique_reply_rank 2 does not exist"),
        ({"args": (lambda: 1,)}, RPCError, "cannot be pickled"),
        ({"method": lambda worker: 1}, RPCError, "must be a method name"),
    ],
)
def test_mp_rpc_arguments_are_refused_before_sending(
    mp_executor: MultiprocExecutor, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    call: dict[str, Any] = {"method": "echo", "args": (1,), **kwargs}
    with pytest.raises(error, match=match):
        mp_executor.collective_rpc(**call)
    assert mp_executor.collective_rpc("echo", (2,)) == [2, 2]


def test_mp_admission_names_the_field_that_cannot_be_pickled(
    mp_executor: MultiprocExecutor,
) -> None:
    params = SamplingParams(num_inference_steps=2, extra_args={"callback": lambda: None})
    with pytest.raises(InvalidFieldError) as info:
        mp_executor.validate_request("cat", params)
    assert (info.value.owner, info.value.field) == ("SamplingParams", "extra_args")
    with pytest.raises(InvalidFieldError) as info:
        mp_executor.validate_request(lambda: None, SamplingParams())
    assert (info.value.owner, info.value.field) == ("request", "prompt")


def test_deep_prompts_are_refused_by_field_before_pickling(mp_executor: MultiprocExecutor) -> None:
    deep: list[Any] = []
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(InvalidFieldError, match="nest deeper") as info:
        mp_executor.validate_request(deep, SamplingParams())
    assert info.value.field == "prompt"


def test_uni_refuses_a_timeout_it_cannot_honour() -> None:
    executor = UniProcExecutor(EngineConfig(pipeline="testing-noise", device="cpu"))
    try:
        with pytest.raises(RPCError, match="cannot abandon"):
            executor.collective_rpc("device_name", timeout=1.0)
        with pytest.raises(InvalidFieldError, match=r"collective_rpc\.timeout"):
            executor.collective_rpc("device_name", timeout=math.nan)
        with pytest.raises(RPCError, match="unique_reply_rank False"):
            executor.collective_rpc("device_name", unique_reply_rank=False)  # type: ignore[arg-type]
        assert executor.collective_rpc("device_name", timeout=math.inf) == ["cpu"]
    finally:
        executor.shutdown()
