"""LoRA adapters over HTTP: models of their own (the openai client), vLLM's load
and unload routes (plain HTTP, off by default), and metrics per adapter."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from lora_adapters import write_adapter
from test_serving import GENERATIONS, Served, decode_png, serving, wait_until

from diffusion_runtime import DiffusionEngine, EngineConfig, LoRARequest, SamplingParams
from diffusion_runtime.core import EngineCore
from diffusion_runtime.serving import ServerConfig, build_app

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
STEPS = 4


def digits_config() -> EngineConfig:
    return EngineConfig(
        pipeline="digits",
        device="cpu",
        warmup=False,
        execution_mode="step",
        max_loras=2,
        max_cpu_loras=2,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    directory = tmp_path_factory.mktemp("adapters")
    return [write_adapter(directory / f"a{i}.safetensors", seed=i) for i in (1, 2, 3)]


@pytest.fixture
def served() -> Iterator[Served]:
    with serving(digits_config(), ServerConfig(lora_updates=True)) as served:
        yield served


def image_of(client: openai.OpenAI, model: str) -> torch.Tensor:
    result = client.images.generate(
        model=model, prompt="3", extra_body={"seed": 5, "num_inference_steps": STEPS}
    )
    assert result.data is not None and result.data[0].b64_json is not None
    return decode_png(result.data[0].b64_json)


def direct_png_pixels(lora: LoRARequest) -> torch.Tensor:
    """The request run on an engine core of the same config, as a PNG's pixels."""
    core = EngineCore(digits_config())
    try:
        core.add_request("direct", "3", SamplingParams(num_inference_steps=STEPS, lora=lora), 5)
        images = None
        while core.has_unfinished():
            for output in core.step().outputs:
                images = output.image_batch if output.finished else images
    finally:
        core.shutdown()
    assert images is not None
    return (images.clamp(0, 1) * 255).round() / 255


def test_the_routes_are_off_unless_asked_for(files: list[Path]) -> None:
    with serving(digits_config()) as served:
        body = {"lora_name": "a", "lora_path": str(files[0])}
        assert served.http.post(LOAD, json=body).status_code == 404
        assert served.http.post(UNLOAD, json={"lora_name": "a"}).status_code == 404
    base_only = EngineConfig(pipeline="digits", device="cpu")
    with (
        DiffusionEngine.make_engine(base_only) as engine,
        pytest.raises(ValueError, match="max_loras"),
    ):
        build_app(engine, ServerConfig(lora_updates=True))


def test_the_serve_flag_turns_adapters_and_the_routes_on(tmp_path: Path, files: list[Path]) -> None:
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "diffusion_runtime.cli", "serve", "--port", "0"]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*command, "--enable-lora-updates"], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            url_line = re.compile(r"serving model 'digits' at (http://127\.0\.0\.1:\d+)")
            wait_until(lambda: url_line.search(log_path.read_text()) is not None, 120)
            match = url_line.search(log_path.read_text())
            assert match is not None
            body = {"lora_name": "bold", "lora_path": str(files[0])}
            answer = httpx.post(f"{match.group(1)}{LOAD}", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
        finally:
            process.terminate()
            code = process.wait(60)
    assert code == 0, log_path.read_text()


def test_a_loaded_adapter_is_a_model_that_runs_with_it(served: Served, files: list[Path]) -> None:
    answer = served.http.post(LOAD, json={"lora_name": "bold", "lora_path": str(files[0])})
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'bold' added successfully."
    client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="unused", max_retries=0)
    try:
        assert [model.id for model in client.models.list()] == ["digits", "bold"]
        card = client.models.retrieve("bold")
        assert (card.id, card.parent, card.root) == ("bold", "digits", str(files[0]))
        bold, base = image_of(client, "bold"), image_of(client, "digits")
        assert torch.equal(bold, direct_png_pixels(LoRARequest("bold", 1, str(files[0]))))
        assert not torch.equal(bold, base)
        assert served.metric("diffusion_lora_requests_total", adapter_id="1") == 1

        answer = served.http.post(UNLOAD, json={"lora_name": "bold"})
        assert answer.status_code == 200, answer.text
        assert answer.text == "Success: LoRA adapter 'bold' removed successfully."
        assert [model.id for model in client.models.list()] == ["digits"]
        with pytest.raises(openai.NotFoundError, match="does not exist") as refused:
            image_of(client, "bold")
        assert refused.value.code == "model_not_found"
    finally:
        client.close()
    assert served.engine.list_loras() == []


def test_an_evicted_adapter_is_still_served_and_evictions_are_counted(
    served: Served, files: list[Path]
) -> None:
    for name, path in zip(("a", "b", "c"), files, strict=True):  # two host slots: c evicts a
        answer = served.http.post(LOAD, json={"lora_name": name, "lora_path": str(path)})
        assert answer.status_code == 200, answer.text
    assert served.engine.list_loras() == [2, 3]
    assert served.metric("diffusion_lora_evictions_total") == 1
    body = {"prompt": "3", "model": "a", "seed": 5, "num_inference_steps": STEPS}
    answer = served.http.post(GENERATIONS, json=body)  # loads a again on demand, evicting b
    assert answer.status_code == 200, answer.text
    assert served.engine.list_loras() == [1, 3]
    assert served.metric("diffusion_lora_evictions_total") == 2
    assert served.metric("diffusion_lora_requests_total", adapter_id="1") == 1


def test_a_load_with_no_room_is_a_conflict(served: Served, files: list[Path]) -> None:
    for name, path in zip(("a", "b"), files, strict=False):
        assert served.http.post(LOAD, json={"lora_name": name, "lora_path": str(path)}).is_success
    assert served.engine.pin_lora(1) and served.engine.pin_lora(2)  # nothing may be evicted
    answer = served.http.post(LOAD, json={"lora_name": "c", "lora_path": str(files[2])})
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "conflict"
    assert "pinned or used" in answer.json()["error"]["message"]
    assert served.http.get("/v1/models/c").status_code == 404


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        (LOAD, {"lora_name": "x"}, 400, "lora_path"),
        (LOAD, {"lora_name": 7, "lora_path": "p"}, 400, "lora_name"),
        (LOAD, {"lora_name": "x", "lora_path": "p", "scale": 2}, 400, "scale"),
        (LOAD, {"lora_name": "x", "lora_path": "/no/such/file"}, 400, "lora_path"),
        (LOAD, {"lora_name": "digits", "lora_path": "p"}, 400, "lora_name"),
        (LOAD, {"lora_name": " ", "lora_path": "p"}, 400, "lora_name"),
        (UNLOAD, {}, 400, "lora_name"),
        (UNLOAD, {"lora_name": "never-loaded"}, 404, "lora_name"),
    ],
)
def test_a_bad_body_is_answered_naming_the_field(
    served: Served, route: str, body: dict[str, object], status: int, param: str
) -> None:
    answer = served.http.post(route, json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_name_already_served_is_refused(served: Served, files: list[Path]) -> None:
    body = {"lora_name": "a", "lora_path": str(files[0])}
    assert served.http.post(LOAD, json=body).status_code == 200
    again = served.http.post(LOAD, json=body | {"lora_path": str(files[1])})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    assert served.engine.list_loras() == [1]


def test_the_docs_example_serves_an_adapter_as_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).parent.parent / "docs" / "lora.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "lora_updates" in b]
    exec(compile(block, "docs/lora.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == [
        "Success: LoRA adapter 'bold' added successfully.",
        "['digits', 'bold']",
    ]
