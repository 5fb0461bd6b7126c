"""The command line as a user runs it: a separate process, its exit status and its output.

Every refused input is reported as one ``error: ...`` line with exit status 2
and no traceback, before any image is generated.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tqdm import tqdm

from diffusion_runtime import DiffusionEngine, SamplingParams
from diffusion_runtime.cli import main, progress_units, run_with_progress

ROOT = Path(__file__).parent.parent


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "diffusion_runtime.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_refused(run: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit status 2, no traceback, and one ``error:`` line on stderr holding ``message``."""
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    [line] = run.stderr.splitlines()
    assert line.startswith("error: ")
    assert message in line


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        ("nosuch.module:Thing", "--pipeline 'nosuch.module:Thing' does not import: No module"),
        ("os:getcwd", "--pipeline 'os:getcwd' cannot be called as factory(device=...)"),
        ("diffusers", "missing a required argument: 'path'; pass --pipeline-arg path=VALUE"),
    ],
)
def test_a_pipeline_that_cannot_be_built_is_refused(
    tmp_path: Path, pipeline: str, message: str
) -> None:
    run = run_cli("generate", "--pipeline", pipeline, "--device", "cpu", cwd=tmp_path)
    assert_refused(run, message)
    assert not (tmp_path / "out").exists()


def test_pipeline_args_reach_the_factory(tmp_path: Path) -> None:
    run = run_cli(
        "generate", "a", "--pipeline", "testing-noise", "--pipeline-arg", "size=8",
        "--pipeline-arg", "channels=1", "--steps", "2", "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    with Image.open(tmp_path / "out" / "000-a-0.png") as image:
        assert (image.size, image.mode) == ((8, 8), "L")


def test_a_malformed_pipeline_arg_is_refused(tmp_path: Path) -> None:
    run = run_cli("generate", "--pipeline-arg", "size", "--device", "cpu", cwd=tmp_path)
    assert_refused(run, "--pipeline-arg 'size' must have the form NAME=VALUE")


def test_an_out_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a directory")
    run = run_cli("generate", "--out", "taken", "--device", "cpu", cwd=tmp_path)
    assert_refused(run, "--out 'taken' exists and is not a directory")


def read_only_directory(tmp_path: Path) -> Path:
    """A directory this process cannot write to (root ignores permission bits: use /sys)."""
    for candidate in (tmp_path / "read-only", Path("/sys")):
        candidate.mkdir(exist_ok=True)
        if candidate != Path("/sys"):
            candidate.chmod(0o555)
        try:
            with tempfile.TemporaryFile(dir=candidate):
                pass
        except OSError:
            return candidate
    pytest.skip("no read-only directory on this machine")


def test_a_read_only_out_directory_is_refused_before_generating(tmp_path: Path) -> None:
    read_only = read_only_directory(tmp_path)
    run = run_cli("generate", "--out", str(read_only), "--device", "cpu", cwd=tmp_path)
    assert_refused(run, f"--out {str(read_only)!r} is not writable")
    assert run.stdout == ""  # no summary: nothing was generated


def test_auditing_a_missing_trace_is_refused(tmp_path: Path) -> None:
    run = run_cli("audit", "missing.jsonl", cwd=tmp_path)
    assert_refused(run, "cannot read the trace 'missing.jsonl': No such file or directory")


def test_eval_refuses_a_pipeline_it_cannot_score(tmp_path: Path) -> None:
    run = run_cli(
        "eval", "--pipeline", "testing-noise", "--samples", "1", "--steps", "2",
        "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert_refused(run, "eval scores one-channel digit images; pipeline 'testing-noise' made")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused(tmp_path: Path) -> None:
    run = run_cli("generate", "--device", "cuda", "--steps", "2", cwd=tmp_path)
    assert_refused(run, "EngineConfig.device names a CUDA device, but no CUDA device is available")


def test_when_every_request_fails_no_grid_is_announced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "grid.png").write_bytes(b"a grid from an earlier run")
    run = run_cli(
        "generate", "fail", "also fail", "--pipeline", "testing-faults", "--steps", "2",
        "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert "2 requests, 0 images" in run.stdout
    assert "no grid written" in run.stdout
    assert "grid.png" not in run.stdout
    assert (out / "grid.png").read_bytes() == b"a grid from an earlier run"


def mean_brightness(directory: Path) -> float:
    """The mean pixel value in [0, 1] of the PNGs of one prompt written by generate."""
    pixels = [
        np.asarray(Image.open(path).convert("L"), dtype=np.float32) / 255
        for path in sorted(directory.glob("000-*.png"))
    ]
    return float(np.mean(pixels))


def test_generate_lora_draws_with_a_shipped_adapter(tmp_path: Path) -> None:
    common = ["generate", "3", "--num-outputs", "4", "--steps", "10", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "plain")]) == 0
    assert main([*common, "--lora", "inverted", "--out", str(tmp_path / "inverted")]) == 0
    # A light digit on black, then a dark digit on white.
    assert mean_brightness(tmp_path / "inverted") > mean_brightness(tmp_path / "plain") + 0.25


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lora", "italic"], "--lora 'italic' is not a shipped adapter; known: bold, inverted"),
        (["--lora", "bold", "--pipeline", "testing-noise"], "--lora needs --pipeline digits"),
    ],
)
def test_generate_refuses_an_unknown_lora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    out = tmp_path / "out"
    assert main(["generate", *options, "--device", "cpu", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("error: ") and message in line
    assert "Traceback" not in captured.err and not out.exists()


def test_help_explains_every_option_and_shows_defaults(tmp_path: Path) -> None:
    run = run_cli("generate", "--help", cwd=tmp_path)
    assert run.returncode == 0
    text = " ".join(run.stdout.split())  # undo argparse's line wrapping
    assert "--steps STEPS denoising steps per image (default: 25)" in text
    assert "--guidance GUIDANCE classifier-free guidance scale (1: none) (default: 1.0)" in text
    assert "--max-num-seqs MAX_NUM_SEQS largest wave or step batch (default: 16)" in text
    assert "(default: None)" not in text


def test_step_mode_moves_the_progress_bar_at_every_step(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    engine = make_engine("testing-noise", execution_mode="step", streaming_output=True)
    params = [SamplingParams(num_inference_steps=6, seed=s) for s in range(2)]
    total = sum(progress_units(sp, per_step=True) for sp in params)
    frames = io.StringIO()
    with tqdm(total=total, file=frames, mininterval=0, miniters=1, disable=False) as bar:
        outputs = asyncio.run(run_with_progress(engine, ["a", "b"], params, bar))
        assert bar.n == total == 12
    assert all(out.ok for out in outputs)
    shown = {int(count) for count in re.findall(r"(\d+)/12 ", frames.getvalue())}
    # The bar was drawn at steps of the wave, not just when requests finished.
    assert len(shown - {0, 12}) >= 3
