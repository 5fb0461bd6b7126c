"""The operator's /admin routes of the HTTP server: off by default; sleep, wake, profile."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
from test_serving import GENERATIONS, serving

from diffusion_runtime import EngineConfig
from diffusion_runtime.serving import ServerConfig

BODY = {"prompt": "4", "n": 1, "response_format": "b64_json", "num_inference_steps": 3, "seed": 9}


def test_admin_routes_are_off_by_default() -> None:
    with serving(EngineConfig(pipeline="testing-noise", device="cpu")) as served:
        assert served.http.post("/admin/sleep").status_code == 404
        assert served.http.get("/admin/sleeping").status_code == 404


def test_a_request_sent_while_asleep_waits_for_the_wake_and_profiles_are_written(
    tmp_path: Path,
) -> None:
    engine_config = EngineConfig(pipeline="digits", device="cpu", profile_dir=str(tmp_path))
    with serving(engine_config, ServerConfig(admin_routes=True)) as served:
        http = served.http
        before = http.post(GENERATIONS, json=BODY).json()["data"]
        assert http.post("/admin/wake_up").status_code == 409
        assert http.post("/admin/sleep", params={"level": 3}).status_code == 400
        assert http.post("/admin/sleep", params={"level": 2}).json() == {
            "sleeping": True,
            "level": 2,
        }
        assert http.get("/admin/sleeping").json() == {"sleeping": True, "state": "sleeping"}
        with (
            concurrent.futures.ThreadPoolExecutor(1) as pool,
            httpx.Client(base_url=served.server.url, timeout=60) as other,
        ):
            waiting = pool.submit(other.post, GENERATIONS, json=BODY)
            time.sleep(0.5)
            assert not waiting.done()
            [trace] = http.post("/admin/start_profile", params={"prefix": "http"}).json()["traces"]
            assert http.post("/admin/wake_up").json() == {"sleeping": False}
            after = waiting.result(60).json()["data"]
        assert http.post("/admin/stop_profile").json() == {"traces": [trace]}
        assert after == before and Path(trace).is_file()
        assert http.post("/admin/start_profile", params={"prefix": "../x"}).status_code == 400
