"""HTTP vs in process: N concurrent clients on the digits model, side by side in one run.

Each of ``clients`` clients sends ``requests_per_client`` requests one after
another (a closed loop), so up to ``clients`` requests are in flight. In
process, a client is an asyncio task calling ``add_request`` and reading
``stream``; over HTTP, it is a keep-alive connection posting to a
``diffusion-runtime serve`` process (started here, on a free port) and
reading the JSON answer with the PNG inside. The HTTP client is the lean one
of :mod:`~diffusion_runtime.bench.lean_http`, so that on a small machine the
load generator takes as little CPU as it can from the server it measures.
Both sides use the same engine settings, and the rounds alternate (in
process, HTTP, in process, HTTP) so load on the machine hits both alike.
Latency is per request, send to answer.

Each engine setting of :data:`SETTINGS` (request mode, request mode with
admission coalescing, step mode) runs once with a single client (the
per-request cost of HTTP alone) and once with ``clients``. The HTTP side
also reports what the server saw: the engine's mean admission-to-completion
time, the mean wave size, and the CPU the server process and the client
spent per request, which tell queueing in the engine apart from time spent
in HTTP on either end.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import msgspec

from diffusion_runtime.bench.lean_http import LeanConnection
from diffusion_runtime.bench.stats import Stopwatch, percentile
from diffusion_runtime.config import EngineConfig
from diffusion_runtime.engine import DiffusionEngine
from diffusion_runtime.sampling_params import SamplingParams

_URL_LINE = re.compile(r"serving model .* at (http://\S+)")


@attrs.frozen
class ServerProcess:
    url: str
    pid: int


@contextmanager
def serve_process(config: EngineConfig, timeout_s: float = 120.0) -> Iterator[ServerProcess]:
    """Run ``diffusion-runtime serve`` with the digits pipeline and ``config``'s device,
    batch and thread settings on a free port; yield its URL; stop it at the end."""
    import httpx

    command = [
        sys.executable, "-m", "diffusion_runtime.cli", "serve", "--port", "0",
        "--device", config.device, "--max-num-seqs", str(config.max_num_seqs),
        "--mode", config.execution_mode,
        "--max-queue-len", "4096", "--batch-wait-ms", str(config.request_batch_max_wait_ms),
    ]  # fmt: skip
    if config.intra_op_threads is not None:
        command += ["--intra-op-threads", str(config.intra_op_threads)]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            url = _wait_for_url(process, log, timeout_s)
            httpx.get(f"{url}/health", timeout=timeout_s).raise_for_status()
            yield ServerProcess(url, process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_for_url(process: subprocess.Popen[str], log: Any, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log.seek(0)
        match = _URL_LINE.search(log.read())
        if match is not None:
            return match.group(1)
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited while starting:\n{log.read()}")
        time.sleep(0.05)
    raise TimeoutError(f"the server did not start within {timeout_s} s")


async def _closed_loop(
    clients: int, requests_per_client: int, call: Callable[[int, int], Awaitable[None]]
) -> tuple[float, list[float]]:
    """Wall seconds and per-request latencies of ``clients`` looping over
    ``call(client, request_number)``."""
    latencies: list[float] = []

    async def client(index: int) -> None:
        for i in range(requests_per_client):
            watch = Stopwatch()
            await call(index, index * requests_per_client + i)
            latencies.append(watch.seconds())

    wall = Stopwatch()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return wall.seconds(), latencies


def _in_process(
    engine: DiffusionEngine, params: SamplingParams, clients: int, per_client: int
) -> tuple[float, list[float]]:
    async def call(client: int, index: int) -> None:
        request_id = await engine.add_request(str(index % 10), params)
        async for output in engine.stream(request_id):
            if output.finished and not output.ok:
                raise RuntimeError(f"request failed: {output.error}")

    async def load() -> tuple[float, list[float]]:
        await _closed_loop(clients, 1, call)  # warm-up
        return await _closed_loop(clients, per_client, call)

    return asyncio.run(load())


def _over_http(url: str, steps: int, clients: int, per_client: int) -> tuple[float, list[float]]:
    async def load() -> tuple[float, list[float]]:
        connections = [await LeanConnection.open(url) for _ in range(clients)]
        try:

            async def call(client: int, index: int) -> None:
                request = {"prompt": str(index % 10), "num_inference_steps": steps}
                body = msgspec.json.encode(request)
                status, answer = await connections[client].post_json("/v1/images/generations", body)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: {answer[:200]!r}")
                if not msgspec.json.decode(answer)["data"][0]["b64_json"]:
                    raise RuntimeError("an answer without an image")

            await _closed_loop(clients, 1, call)  # warm-up
            return await _closed_loop(clients, per_client, call)
        finally:
            for connection in connections:
                await connection.close()

    return asyncio.run(load())


@attrs.define
class _Side:
    """What one side (in process or HTTP) measured over its rounds."""

    walls: list[float] = attrs.Factory(list)
    latencies: list[float] = attrs.Factory(list)

    def add(self, measured: tuple[float, list[float]]) -> None:
        self.walls.append(measured[0])
        self.latencies.extend(measured[1])

    def summary(self) -> dict[str, float]:
        return {
            "requests_per_s": round(len(self.latencies) / sum(self.walls), 1),
            "p50_ms": round(percentile(self.latencies, 50) * 1000, 2),
            "p99_ms": round(percentile(self.latencies, 99) * 1000, 2),
        }


def _server_view(url: str) -> dict[str, float]:
    """The server's own counters: engine latency sums, waves, batch sizes."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "diffusion_e2e_latency_seconds_sum",
        "diffusion_e2e_latency_seconds_count",
        "diffusion_batch_size_sum",
        "diffusion_batch_size_count",
    }
    text = httpx.get(f"{url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: The engine settings measured, each on both sides: (name, execution mode, batch wait ms).
SETTINGS = (
    ("request", "request", 0.0),
    ("request_coalescing_4ms", "request", 4.0),
    ("step", "step", 0.0),
)


def run(
    clients: int = 16,
    requests_per_client: int = 8,
    steps: int = 25,
    rounds: int = 2,
    intra_op_threads: int | None = 1,
) -> dict[str, Any]:
    """Every engine setting of :data:`SETTINGS`, with one client and with ``clients``."""
    result: dict[str, Any] = {
        "benchmark": "http",
        "pipeline": "digits",
        "steps": steps,
        "intra_op_threads": intra_op_threads,
    }
    for name, mode, batch_wait_ms in SETTINGS:
        config = EngineConfig(
            pipeline="digits",
            device="cpu",
            max_num_seqs=clients,
            intra_op_threads=intra_op_threads,
            execution_mode=mode,
            request_batch_max_wait_ms=batch_wait_ms,
        )
        result[name] = _one_setting(config, steps, clients, requests_per_client, rounds)
    return result


def _one_setting(
    config: EngineConfig, steps: int, clients: int, requests_per_client: int, rounds: int
) -> dict[str, Any]:
    params = SamplingParams(num_inference_steps=steps)
    result: dict[str, Any] = {}
    with serve_process(config) as server:
        for concurrency in (1, clients):
            per_client = requests_per_client * clients // concurrency
            in_process, http = _Side(), _Side()
            before = _server_view(server.url)
            server_cpu = client_cpu = 0.0
            for _ in range(rounds):
                with DiffusionEngine.make_engine(config) as engine:
                    in_process.add(_in_process(engine, params, concurrency, per_client))
                cpu_start, client_watch = _cpu_seconds(server.pid), Stopwatch(time.process_time)
                http.add(_over_http(server.url, steps, concurrency, per_client))
                server_cpu += _cpu_seconds(server.pid) - cpu_start
                client_cpu += client_watch.seconds()
            after = _server_view(server.url)
            delta = {name: after[name] - before[name] for name in after}
            served = len(http.latencies)
            table: dict[str, Any] = {"in_process": in_process.summary(), "http": http.summary()}
            table["http"].update(
                engine_e2e_mean_ms=round(
                    1000
                    * delta["diffusion_e2e_latency_seconds_sum"]
                    / delta["diffusion_e2e_latency_seconds_count"],
                    2,
                ),
                mean_batch=round(
                    delta["diffusion_batch_size_sum"] / delta["diffusion_batch_size_count"], 1
                ),
                server_cpu_ms_per_request=round(1000 * server_cpu / served, 2),
                client_cpu_ms_per_request=round(1000 * client_cpu / served, 2),
            )
            table["http_overhead_p50_ms"] = round(
                table["http"]["p50_ms"] - table["in_process"]["p50_ms"], 2
            )
            table["http_over_in_process_throughput"] = round(
                table["http"]["requests_per_s"] / table["in_process"]["requests_per_s"], 3
            )
            result[f"{concurrency}_clients"] = table
    return result
