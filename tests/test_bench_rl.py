"""The RL benchmark runs end to end at tiny sizes from the command line (its timings
mean nothing here; its byte counts do)."""

from __future__ import annotations

import json

import pytest

from diffusion_runtime.bench.rl import PLACES, WAYS
from diffusion_runtime.cli import BENCHMARKS, main


def test_bench_rl_reports_time_and_bytes_of_both_ways_in_both_places(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert BENCHMARKS["rl"] == "diffusion_runtime.bench.rl:run"
    assert main(["bench", "rl", "--requests", "2", "--steps", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["benchmark"], result["requests"], result["steps"]) == ("rl", 2, 3)
    image = 1 * 8 * 8 * 4  # one float32 8x8 grey image per request
    # Four latents of 64 float32 pixels (noise and 3 steps), and 2 float64 log-probs:
    # DDIM's last step draws no noise.
    full = image + 4 * 64 * 4 + 2 * 8
    for place in PLACES:
        row = result[place]
        for way in WAYS:
            assert 0 < row[way]["fastest_ms"] <= row[way]["median_ms"]
            assert row[way]["median_ms_per_request"] > 0
            assert ("median_cpu_ms" in row[way]) == (place == "in_process")
        ratios = {"time", "fastest_time", "output_bytes"}
        assert set(row["full_over_images"]) == ratios | (
            {"cpu_time"} if place == "in_process" else set()
        )
        assert row["images"]["output_bytes_per_request"] == image
        assert row["full"]["output_bytes_per_request"] == full
        assert row["full_over_images"]["output_bytes"] == round(full / image, 2)
        assert row["full_over_images"]["time"] > 0 and row["full_over_images"]["fastest_time"] > 0
    # Through the stage the tensors come as raw frames of exactly their bytes; the
    # msgpack header grows only by the step numbers and tensor layouts.
    socket = {way: result["stage"][way]["socket_bytes_per_request"] for way in WAYS}
    assert socket["images"]["raw_frames"] == image and socket["full"]["raw_frames"] == full
    assert 0 < socket["full"]["headers"] - socket["images"]["headers"] < 200
    assert result["stage_trajectories_equal_in_process"] is True


def test_bench_refuses_an_option_its_benchmark_does_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "sleep", "--requests", "2"]) == 2
    assert "bench sleep takes no --requests" in capsys.readouterr().err
