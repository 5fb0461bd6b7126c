"""The HTTP server: a real uvicorn server on a free port, driven by httpx and the openai client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import engine_threads, factory_of
from fastapi import Depends, FastAPI, Request
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response

from diffusion_runtime import DiffusionEngine, EngineConfig, InvalidFieldError, SamplingParams
from diffusion_runtime.bench.lean_http import LeanConnection
from diffusion_runtime.pipelines.digits import DigitClassifier
from diffusion_runtime.serving import EngineMetrics, ServerConfig, ServerThread, build_app
from diffusion_runtime.serving.images import ImageStore
from diffusion_runtime.serving.json_body_route import JsonBodyRoute
from diffusion_runtime.serving.png import encode_png
from diffusion_runtime.serving.schema import ImageGenerationRequest
from diffusion_runtime.testing.pipelines import FaultInjectingPipeline

GENERATIONS = "/v1/images/generations"
FEW_STEPS = 5


class Served:
    """An engine, the app over it and the uvicorn server running it."""

    def __init__(self, engine: DiffusionEngine, server: ServerThread, app: Any) -> None:
        self.engine = engine
        self.server = server
        self.app = app
        self.http = httpx.Client(base_url=server.url, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from ``/metrics`` (0 when absent)."""
        text = self.http.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0

    def open_request(self, body: dict[str, Any]) -> socket.socket:
        """Send a generation request on a raw connection the test closes to disconnect."""
        address = urlsplit(self.server.url)
        assert address.hostname is not None and address.port is not None
        data = json.dumps(body).encode()
        sock = socket.create_connection((address.hostname, address.port))
        head = (
            f"POST {GENERATIONS} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        return sock


@contextmanager
def serving(
    engine_config: EngineConfig, server_config: ServerConfig | None = None
) -> Iterator[Served]:
    """Start an engine and a server over it; stop both and check nothing is left running."""
    threads_before = server_threads()
    with DiffusionEngine.make_engine(engine_config) as engine:
        app = build_app(engine, server_config)
        with ServerThread(app) as server:
            served = Served(engine, server, app)
            try:
                yield served
            finally:
                served.http.close()
        assert len(app.state.generation.readers) == 0
    assert server_threads() == threads_before


def server_threads() -> set[threading.Thread]:
    """The engine loops and uvicorn servers running now (another fixture's may be among them)."""
    return set(engine_threads()) | {t for t in threading.enumerate() if t.name == "uvicorn-server"}


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def held_nothing(engine: DiffusionEngine) -> bool:
    snapshot = engine.snapshot()
    return not (
        snapshot.scheduler_ids or snapshot.runner_cached_ids or snapshot.unclaimed_stream_ids
    )


def decode_png(b64_json: str) -> torch.Tensor:
    """A base64 PNG as a ``(1, 1, H, W)`` tensor in ``[0, 1]``."""
    image = Image.open(io.BytesIO(base64.b64decode(b64_json)))
    assert image.format == "PNG"
    pixels = torch.frombuffer(bytearray(image.convert("L").tobytes()), dtype=torch.uint8)
    return (pixels.float() / 255).reshape(1, 1, image.height, image.width)


@pytest.fixture(scope="module")
def digits() -> Iterator[Served]:
    with serving(EngineConfig(pipeline="digits", device="cpu", max_num_seqs=8)) as served:
        yield served


def fault_config(pipeline: FaultInjectingPipeline, **overrides: Any) -> EngineConfig:
    return EngineConfig(pipeline=factory_of(pipeline), device="cpu", warmup=False, **overrides)


def test_the_openai_client_gets_a_png_of_a_seven(digits: Served) -> None:
    client = openai.OpenAI(base_url=f"{digits.server.url}/v1", api_key="unused", max_retries=0)
    try:
        plain = client.images.generate(model="digits", prompt="7")
        seeded = client.images.generate(
            model="digits", prompt="7", response_format="b64_json", extra_body={"seed": 3}
        )
    finally:
        client.close()
    for result in (plain, seeded):
        assert result.data is not None and len(result.data) == 1
        assert result.data[0].b64_json is not None
        assert decode_png(result.data[0].b64_json).shape == (1, 1, 8, 8)
    # A fixed seed keeps the check deterministic (the classifier agrees with nearly every sample).
    assert seeded.data is not None and seeded.data[0].b64_json is not None
    image = decode_png(seeded.data[0].b64_json)
    assert DigitClassifier.load().predict(image).tolist() == [7]


def test_n_images_of_a_requested_size_are_served_as_urls(digits: Served) -> None:
    body = {"prompt": "2", "n": 3, "size": "32x32", "response_format": "url"}
    answer = digits.http.post(GENERATIONS, json=body | {"num_inference_steps": FEW_STEPS})
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    assert payload["size"] == "32x32" and len(payload["data"]) == 3
    for item in payload["data"]:
        image = digits.http.get(item["url"])
        assert image.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(image.content)).size == (32, 32)
    missing = digits.http.get("/v1/images/files/never-made.png")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


def test_the_same_seed_gives_the_same_image(digits: Served) -> None:
    body = {"prompt": "4", "seed": 11, "num_inference_steps": FEW_STEPS, "guidance_scale": 1.5}
    first, second = (digits.http.post(GENERATIONS, json=body).json() for _ in range(2))
    assert first["seed"] == second["seed"] == 11
    assert first["data"] == second["data"]
    scheduled = digits.http.post(GENERATIONS, json=body | {"priority": -3, "deadline": 30.0})
    assert scheduled.status_code == 200, scheduled.text
    assert scheduled.json()["data"] == first["data"], "scheduling fields never change the image"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x"}, "prompt", "digit"),
        ({"prompt": "7" * 4001}, "prompt", "at most 4000 characters"),
        ({"prompt": 7}, "prompt", "string"),
        ({"size": "9x9"}, "size", "multiple of 8"),
        ({"size": "16x8"}, "size", "square"),
        ({"size": "big"}, "size", "WIDTHxHEIGHT"),
        ({"n": 0}, "n", "[1, 10]"),
        ({"n": 11}, "n", "[1, 10]"),
        ({"num_inference_steps": 0}, "num_inference_steps", "integer"),
        ({"guidance_scale": -1.0}, "guidance_scale", "finite number"),
        ({"seed": -1}, "seed", "integer"),
        ({"priority": 2**40}, "priority", "integer"),
        ({"deadline": 0.0}, "deadline", "finite number"),
        ({"quality": "hd"}, "quality", "does not support this field"),
        ({"response_format": "jpeg"}, "response_format", "b64_json"),
        ({"stream": True, "response_format": "url"}, "response_format", "inline"),
    ],
)
def test_a_bad_field_gets_a_400_naming_it(
    digits: Served, body: dict[str, Any], param: str, words: str
) -> None:
    answer = digits.http.post(GENERATIONS, json={"prompt": "1"} | body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert "Traceback" not in answer.text


def test_the_benchmarks_lean_client_reads_what_httpx_reads(digits: Served) -> None:
    """``bench http``'s load generator: same status and body as httpx, on one
    keep-alive connection for several answers, errors included."""
    body = {"prompt": "6", "seed": 5, "num_inference_steps": FEW_STEPS}
    expected = digits.http.post(GENERATIONS, json=body).json()

    async def over_one_connection() -> list[tuple[int, bytes]]:
        connection = await LeanConnection.open(digits.server.url)
        try:
            return [
                await connection.post_json(GENERATIONS, json.dumps(request).encode())
                for request in (body, {"prompt": "x"}, body)
            ]
        finally:
            await connection.close()

    (first, first_body), (refused, refusal), (again, again_body) = asyncio.run(
        over_one_connection()
    )
    assert (first, refused, again) == (200, 400, 200)
    assert json.loads(first_body)["data"] == json.loads(again_body)["data"] == expected["data"]
    assert json.loads(refusal)["error"]["param"] == "prompt"


def test_a_body_that_is_not_json_gets_a_400(digits: Served) -> None:
    answer = digits.http.post(
        GENERATIONS, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_body_not_sent_as_json_gets_a_400_naming_the_body(digits: Served) -> None:
    answer = digits.http.post(
        GENERATIONS, content=b'{"prompt": "1"}', headers={"content-type": "text/plain"}
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "body"
    assert "JSON" in answer.json()["error"]["message"]
    vendor_json = digits.http.post(
        GENERATIONS,
        content=json.dumps({"prompt": "1", "num_inference_steps": FEW_STEPS}).encode(),
        headers={"content-type": "application/vnd.example+json; charset=utf-8"},
    )
    assert vendor_json.status_code == 200, vendor_json.text


def test_an_oversized_body_gets_a_413(digits: Served) -> None:
    before = digits.metric("diffusion_http_refused_total", reason="body_too_large")
    answer = digits.http.post(GENERATIONS, content=b"x" * 70_000)
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"x" * 10_000

    chunked = digits.http.post(GENERATIONS, content=chunks())
    assert chunked.status_code == 413
    assert chunked.json()["error"]["param"] == "body"
    after = digits.metric("diffusion_http_refused_total", reason="body_too_large")
    assert after == before + 2


def test_an_unknown_model_or_path_gets_a_404(digits: Served) -> None:
    answer = digits.http.post(GENERATIONS, json={"prompt": "1", "model": "dall-e-3"})
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"
    assert digits.http.get("/v1/models/dall-e-3").status_code == 404
    assert digits.http.get("/v2/nothing").json()["error"]["code"] == "not_found"


def test_models_health_and_version(digits: Served) -> None:
    models = digits.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["digits"]
    assert digits.http.get("/v1/models/digits").json()["object"] == "model"
    assert digits.http.get("/health").json() == {"status": "ok"}
    assert digits.http.get("/version").json()["version"]


def test_metrics_move_as_requests_run(digits: Served) -> None:
    names = (
        ("diffusion_requests_total", {"status": "completed"}),
        ("diffusion_requests_admitted_total", {}),
        ("diffusion_waves_total", {}),
        ("diffusion_batch_size_count", {}),
        ("diffusion_queue_latency_seconds_count", {}),
        ("diffusion_execution_latency_seconds_count", {}),
        ("diffusion_e2e_latency_seconds_count", {}),
        (
            "diffusion_http_responses_total",
            {"route": "/v1/images/generations", "code": "200"},
        ),
    )
    before = {name: digits.metric(name, **labels) for name, labels in names}
    steps_before = digits.metric("diffusion_denoise_steps_total")
    body = {"prompt": "5", "num_inference_steps": FEW_STEPS}
    assert digits.http.post(GENERATIONS, json=body).status_code == 200
    for name, labels in names:
        assert digits.metric(name, **labels) == before[name] + 1, name
    assert digits.metric("diffusion_denoise_steps_total") == steps_before + FEW_STEPS
    assert digits.metric("diffusion_requests_running") == 0
    assert digits.metric("diffusion_requests_waiting") == 0
    assert digits.metric("diffusion_engine_healthy") == 1


def test_progress_streams_as_server_sent_events() -> None:
    config = EngineConfig(
        pipeline="digits", device="cpu", streaming_output=True, preview_interval=2
    )
    with serving(config) as served:
        body = {"prompt": "8", "stream": True, "num_inference_steps": 4, "n": 2}
        events = []
        with served.http.stream("POST", GENERATIONS, json=body) as answer:
            assert answer.headers["content-type"].startswith("text/event-stream")
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
        progress = [e for e in events if e["type"] == "image_generation.progress"]
        # The last step's output is the final one.
        assert [(e["step"], e["num_steps"]) for e in progress] == [(1, 4), (2, 4), (3, 4)]
        partial = [e for e in events if e["type"] == "image_generation.partial_image"]
        assert [e["partial_image_index"] for e in partial] == [0, 1]  # step 2: one per image
        completed = [e for e in events if e["type"] == "image_generation.completed"]
        assert [e["image_index"] for e in completed] == [0, 1]
        assert events[-1] is completed[-1]
        assert decode_png(completed[0]["b64_json"]).shape == (1, 1, 8, 8)

        client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="-", max_retries=0)
        try:
            stream = client.images.generate(
                model="digits", prompt="8", stream=True, extra_body={"num_inference_steps": 3}
            )
            kinds = [event.type for event in stream]
        finally:
            client.close()
        assert kinds[-1] == "image_generation.completed"
        assert kinds.count("image_generation.progress") == 2


def test_a_full_queue_gets_a_429_with_retry_after() -> None:
    config = EngineConfig(pipeline="digits", device="cpu", max_waiting_requests=1)
    with serving(config, ServerConfig(retry_after_s=3)) as served:
        served.engine.pause()
        waiting = served.open_request({"prompt": "1", "num_inference_steps": FEW_STEPS})
        try:
            wait_until(lambda: served.engine.queue_length == 1)
            answer = served.http.post(GENERATIONS, json={"prompt": "2"})
            assert answer.status_code == 429
            assert answer.headers["retry-after"] == "3"
            assert answer.json()["error"]["code"] == "queue_full"
            assert served.metric("diffusion_http_refused_total", reason="queue_full") == 1
        finally:
            waiting.close()
            served.engine.resume()
        wait_until(lambda: served.metric("diffusion_requests_total", status="aborted") == 1)
        wait_until(lambda: held_nothing(served.engine))


def test_a_client_over_its_limit_gets_a_429_others_do_not() -> None:
    config = EngineConfig(pipeline="digits", device="cpu")
    with serving(config, ServerConfig(per_client_limit=1)) as served:
        served.engine.pause()
        alice = served.open_request({"prompt": "1", "user": "alice"})
        try:
            wait_until(lambda: served.engine.queue_length == 1)
            refused = served.http.post(GENERATIONS, json={"prompt": "2", "user": "alice"})
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "client_limit"
            assert refused.headers["retry-after"] == "1"
            bob = served.open_request({"prompt": "3", "user": "bob"})
            wait_until(lambda: served.engine.queue_length == 2)
            bob.close()
        finally:
            alice.close()
            served.engine.resume()
        wait_until(lambda: served.metric("diffusion_requests_total", status="aborted") == 2)
        wait_until(lambda: held_nothing(served.engine))
        assert served.http.post(GENERATIONS, json={"prompt": "4", "user": "alice"}).is_success


def test_a_client_that_leaves_frees_its_slot_before_the_abort_lands() -> None:
    """The engine is paused, so the abort cannot take effect yet: the client's slot
    is given back when it leaves all the same, and its retry is admitted."""
    config = EngineConfig(pipeline="digits", device="cpu")
    with serving(config, ServerConfig(per_client_limit=1)) as served:
        served.engine.pause()
        retry = None
        try:
            first = served.open_request({"prompt": "1", "user": "alice"})
            wait_until(lambda: served.engine.queue_length == 1)
            first.close()
            wait_until(lambda: served.metric("diffusion_http_client_disconnects_total") == 1)
            retry = served.open_request({"prompt": "2", "user": "alice"})
            wait_until(lambda: served.engine.queue_length == 2)
            assert served.metric("diffusion_http_refused_total", reason="client_limit") == 0
        finally:
            if retry is not None:
                retry.close()
            served.engine.resume()
        wait_until(lambda: served.metric("diffusion_requests_total", status="aborted") == 2)
        wait_until(lambda: held_nothing(served.engine))
        assert served.metric("diffusion_http_client_disconnects_total") == 2


def test_a_client_that_leaves_during_its_body_is_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with serving(EngineConfig(pipeline="digits", device="cpu")) as served:
        address = urlsplit(served.server.url)
        assert address.hostname is not None and address.port is not None
        with socket.create_connection((address.hostname, address.port)) as sock:
            head = (
                f"POST {GENERATIONS} HTTP/1.1\r\nHost: test\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )
            sock.sendall(head.encode() + b'{"prompt": ')
        answered = {"route": GENERATIONS, "code": "499"}
        wait_until(lambda: served.metric("diffusion_http_responses_total", **answered) == 1)
        assert served.http.post(GENERATIONS, json={"prompt": "3"}).is_success
        assert held_nothing(served.engine)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_an_image_route_refuses_dependencies_and_other_signatures() -> None:
    async def endpoint(body: ImageGenerationRequest, request: Request) -> Response:
        raise AssertionError("never called")

    async def three(body: ImageGenerationRequest, request: Request, extra: int) -> Response:
        raise AssertionError("never called")

    app = FastAPI()
    with pytest.raises(TypeError, match="runs no dependencies"):
        app.router.add_api_route(
            "/d", endpoint, methods=["POST"], route_class_override=JsonBodyRoute,
            dependencies=[Depends(lambda: None)],
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"exactly \(body, request\)"):
        app.router.add_api_route("/t", three, methods=["POST"], route_class_override=JsonBodyRoute)


def test_a_closed_engine_gets_a_503() -> None:
    with serving(EngineConfig(pipeline="digits", device="cpu")) as served:
        served.engine.close()
        assert served.http.get("/health").status_code == 503
        answer = served.http.post(GENERATIONS, json={"prompt": "1"})
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "engine_unavailable"
        assert served.metric("diffusion_engine_healthy") == 0


def test_a_dead_engine_gets_a_503_and_counts_the_death(faults: FaultInjectingPipeline) -> None:
    with serving(fault_config(faults)) as served:
        answer = served.http.post(GENERATIONS, json={"prompt": "device-fault"})
        assert answer.status_code == 503
        assert "Traceback" not in answer.text
        assert served.http.get("/health").status_code == 503
        assert served.metric("diffusion_engine_deaths_total") == 1
        assert served.metric("diffusion_requests_total", status="error") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_disconnect_aborts_its_request_and_frees_everything(
    faults: FaultInjectingPipeline, stream: bool
) -> None:
    mode = "step" if stream else "request"
    with serving(fault_config(faults, execution_mode=mode)) as served:
        connection = served.open_request({"prompt": "gate", "stream": stream})
        try:
            assert faults.gate_entered.wait(30)
        finally:
            connection.close()
        # The server has noticed and asked the engine to abort before the wave ends.
        wait_until(lambda: served.metric("diffusion_http_client_disconnects_total") == 1)
        faults.gate_release.set()
        wait_until(lambda: served.metric("diffusion_requests_total", status="aborted") == 1)
        assert served.metric("diffusion_requests_total", status="completed") == 0
        wait_until(lambda: held_nothing(served.engine))
        assert served.metric("diffusion_requests_running") == 0


def test_the_serve_command_starts_with_no_arguments_and_stops_on_sigterm(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "diffusion_runtime.cli", "serve", "--port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url_line = re.compile(r"serving model 'digits' at (http://127\.0\.0\.1:\d+)")
            wait_until(lambda: url_line.search(log_path.read_text()) is not None, 120)
            match = url_line.search(log_path.read_text())
            assert match is not None
            assert httpx.get(f"{match.group(1)}/health").json() == {"status": "ok"}
        finally:
            process.terminate()
            code = process.wait(60)
    assert code == 0, log_path.read_text()
    assert "Application shutdown complete" in log_path.read_text()


def test_engine_metrics_work_without_http() -> None:
    with DiffusionEngine.make_engine(EngineConfig(pipeline="digits", device="cpu")) as engine:
        metrics = EngineMetrics(engine)
        metrics.attach()
        engine.generate(["1", "2"], SamplingParams(num_inference_steps=FEW_STEPS))
        metrics.detach()
        engine.generate(["3"], SamplingParams(num_inference_steps=FEW_STEPS))
    registry = metrics.registry
    assert registry.get_sample_value("diffusion_requests_total", {"status": "completed"}) == 2
    assert registry.get_sample_value("diffusion_e2e_latency_seconds_count") == 2
    assert registry.get_sample_value("diffusion_engine_healthy") == 0  # closed since


def test_the_image_store_forgets_the_oldest_and_the_expired() -> None:
    store = ImageStore(capacity=2, ttl_s=3600)
    names = [store.put(bytes([i])) for i in range(3)]
    assert [store.get(name) for name in names] == [None, b"\x01", b"\x02"]
    expiring = ImageStore(capacity=2, ttl_s=0)
    assert expiring.get(expiring.put(b"png")) is None


@pytest.mark.parametrize("shape", [(8, 8, 1), (5, 7, 3), (33, 2, 4), (1, 1, 1)])
def test_png_encoding_round_trips_through_pillow(shape: tuple[int, int, int]) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    image = Image.open(io.BytesIO(encode_png(pixels)))
    assert image.format == "PNG"
    assert image.mode == {1: "L", 3: "RGB", 4: "RGBA"}[shape[2]]
    assert (np.asarray(image).reshape(shape) == pixels).all()
    with pytest.raises(ValueError, match="2-channel"):
        encode_png(np.zeros((2, 2, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="empty image"):
        encode_png(np.zeros((0, 2, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        encode_png(pixels.astype(np.float32))


def test_server_config_names_the_field_it_refuses() -> None:
    with pytest.raises(InvalidFieldError, match=r"ServerConfig\.max_body_bytes"):
        ServerConfig(max_body_bytes=0)
    with pytest.raises(InvalidFieldError, match=r"ServerConfig\.model_name"):
        ServerConfig(model_name=" ")


def test_a_quiet_stream_sends_keep_alives_until_its_images() -> None:
    config = EngineConfig(pipeline="digits", device="cpu")
    with serving(config, ServerConfig(stream_keepalive_s=0.01)) as served:
        served.engine.pause()
        body = {"prompt": "6", "stream": True, "num_inference_steps": FEW_STEPS}
        kinds, resumed = [], False
        with served.http.stream("POST", GENERATIONS, json=body) as answer:
            for line in answer.iter_lines():
                if line == ": keep-alive" and not resumed:
                    assert served.engine.queue_length == 1  # the request waits, the stream says so
                    served.engine.resume()
                    resumed = True
                elif line.startswith("data: "):
                    kinds.append(json.loads(line.removeprefix("data: "))["type"])
        assert resumed
        assert kinds == ["image_generation.completed"]


def test_a_stream_whose_engine_dies_ends_with_an_error_event(
    faults: FaultInjectingPipeline,
) -> None:
    with serving(fault_config(faults, execution_mode="step")) as served:
        body = {"prompt": "device-fault", "stream": True}
        with served.http.stream("POST", GENERATIONS, json=body) as answer:
            lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
        events = [json.loads(line.removeprefix("data: ")) for line in lines]
        assert [e["type"] for e in events] == ["error"]
        assert events[0]["error"]["code"] == "engine_unavailable"
