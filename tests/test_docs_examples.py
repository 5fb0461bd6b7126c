"""The runnable examples in docs/ and the README still run, and print what the docs say."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import factory_of
from PIL import Image

from diffusion_runtime import DiffusionEngine, SamplingParams

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def python_block(page: Path, marker: str) -> str:
    """The one ```python block of ``page`` that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    [block] = [b for b in blocks if marker in b]
    return block


def run_python(cwd: Path, script: str, *args: str) -> str:
    """Run ``script`` (a file in ``cwd``) as a user would; its stdout, after checking it passed."""
    run = subprocess.run(
        [sys.executable, script, *args],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def run_block(tmp_path: Path, page: Path, marker: str, name: str = "example.py") -> str:
    (tmp_path / name).write_text(python_block(page, marker))
    return run_python(tmp_path, name)


def pytest_file(tmp_path: Path, name: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def documented_text_block(page: Path, after: str) -> str:
    """The ```text block that follows ``after`` in ``page``."""
    text = page.read_text()
    match = re.search(r"```text\n(.*?)```", text[text.index(after) :], re.S)
    assert match is not None
    return match.group(1)


def test_the_auditing_guide_harness_example_passes(tmp_path: Path) -> None:
    text = (DOCS / "auditing.md").read_text()
    example = re.search(r"```python\n(# test_my_pipeline.py\n.*?)```", text, re.S)
    assert example is not None
    (tmp_path / "test_my_pipeline.py").write_text(example.group(1))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_pipeline.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_pipelines_guide_worked_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "pipelines.md").read_text(), re.S)
    [pipeline] = [b for b in blocks if "class FadePipeline" in b]
    [usage] = [b for b in blocks if "from fade import FadePipeline" in b]
    (tmp_path / "fade.py").write_text(pipeline)
    (tmp_path / "run.py").write_text(usage)
    run = subprocess.run(
        [sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_importing_the_package_needs_no_test_tools() -> None:
    code = (
        "import sys, diffusion_runtime, diffusion_runtime.testing.pipelines;"
        "from diffusion_runtime.bench import control_plane;"
        "assert 'hypothesis' not in sys.modules, 'hypothesis imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- README --------------------------------------------------------------------------------


def test_the_readme_python_example_saves_a_visible_three(tmp_path: Path) -> None:
    out = run_block(tmp_path, ROOT / "README.md", 'save("three.png")')
    assert "FINISHED_COMPLETED, 1 image (1, 64, 64), seed=0)" in out
    with Image.open(tmp_path / "three.png") as image:
        assert image.size == (64, 64)


def test_the_readme_async_example_streams_and_aborts(tmp_path: Path) -> None:
    lines = run_block(tmp_path, ROOT / "README.md", "async def main").splitlines()
    assert lines[:5] == [f"RUNNING {step} False" for step in range(1, 5)] + [
        "FINISHED_COMPLETED 5 True"
    ]
    assert lines[5:] == ["FINISHED_ABORTED aborted by the caller"]


# -- user guide ----------------------------------------------------------------------------


def test_the_user_guide_examples_run(tmp_path: Path) -> None:
    guide = DOCS / "user-guide.md"
    out = run_block(tmp_path, guide, 'save("three.png")')
    assert re.fullmatch(
        r"RequestOutput\('.+', FINISHED_COMPLETED, 1 image \(1, 64, 64\), seed=0\)\n", out
    )
    out = run_block(tmp_path, guide, "async def main(engine)")
    assert "FINISHED_ABORTED user cancelled" in out


# -- auditing guide ------------------------------------------------------------------------


def test_the_auditing_guide_trace_example_audits_clean(tmp_path: Path) -> None:
    guide = DOCS / "auditing.md"
    run_block(tmp_path, guide, 'trace_path="run.jsonl"')
    audit = subprocess.run(
        [sys.executable, "-m", "diffusion_runtime.cli", "audit", "run.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert audit.returncode == 0, audit.stderr
    assert f"$ diffusion-runtime audit run.jsonl\n{audit.stdout}```" in guide.read_text()


def test_the_auditing_guide_checker_example_flags_the_big_wave(tmp_path: Path) -> None:
    out = run_block(tmp_path, DOCS / "auditing.md", "class WavesStaySmall")
    assert out == "SITE-001 wave 1 ran 6\n"
    assert "prints `SITE-001 wave 1 ran 6`" in (DOCS / "auditing.md").read_text()


@pytest.fixture
def my_dit(tmp_path: Path) -> Path:
    """A tiny random DiT saved where the docs' diffusers examples load it from."""
    pytest.importorskip("diffusers")
    import diffusers_models

    directory = tmp_path / "my-dit"
    diffusers_models.dit_pipeline().save_pretrained(directory)
    # Published DiT checkpoints name their classes in model_index.json; save_pretrained does not.
    index = json.loads((directory / "model_index.json").read_text())
    index["id2label"] = {"0": "tench, Tinca tinca", "1": "goldfish"}
    (directory / "model_index.json").write_text(json.dumps(index))
    return tmp_path


def test_the_auditing_guide_dit_harness_example_passes(my_dit: Path) -> None:
    (my_dit / "test_my_dit.py").write_text(python_block(DOCS / "auditing.md", "# test_my_dit.py"))
    pytest_file(my_dit, "test_my_dit.py")


# -- diffusers guide -----------------------------------------------------------------------


def test_the_diffusers_guide_examples_run(my_dit: Path) -> None:
    guide = DOCS / "diffusers.md"
    out = run_block(my_dit, guide, "DiTPipeline.from_pretrained")
    assert "FINISHED_COMPLETED, step 25/25, 1 image (3, 16, 16), seed=0)" in out
    run_block(my_dit, guide, 'pipeline="diffusers"')


# Raised inside diffusers' UniPC scheduler under numpy 2 (not by the runtime).
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_the_diffusers_guide_scheduler_notes_hold(
    make_engine: Callable[..., DiffusionEngine],
) -> None:
    pytest.importorskip("diffusers")
    import diffusers_models as models

    from diffusion_runtime.pipelines.diffusers import DiffusersPipeline

    params = SamplingParams(num_inference_steps=3, seed=0)
    # DDPMPipeline with UniPC: diffusers itself raises; the adapter runs it.
    ddpm_unipc = models.with_scheduler(models.ddpm_pipeline(), "UniPCMultistepScheduler")
    with pytest.raises(TypeError, match="generator"):
        ddpm_unipc(num_inference_steps=3, generator=torch.Generator().manual_seed(0))
    engine = make_engine(factory_of(DiffusersPipeline(ddpm_unipc)), warmup=False)
    assert engine.generate([None], params)[0].ok

    # DiTPipeline with DDPM: diffusers' step noise comes from the global RNG, the adapter's
    # from the request's generator.
    dit_ddpm = models.with_scheduler(models.dit_pipeline(), "DDPMScheduler")

    def diffusers_dit(global_seed: int) -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(global_seed)
            generator = torch.Generator().manual_seed(0)
            out = dit_ddpm([1], num_inference_steps=3, generator=generator, output_type="pt")
        images: torch.Tensor = out.images
        return images

    assert not torch.equal(diffusers_dit(1), diffusers_dit(2))  # one seed, two results
    engine = make_engine(factory_of(DiffusersPipeline(dit_ddpm)), warmup=False)
    first, second = (engine.generate([1], params)[0].image_batch for _ in range(2))
    assert first is not None and second is not None and torch.equal(first, second)


# -- worker extensions ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_the_worker_extensions_example_prints_what_the_guide_says(
    tmp_path: Path, workers: int
) -> None:
    guide = DOCS / "worker-extensions.md"
    (tmp_path / "inspect_ext.py").write_text(python_block(guide, "class Inspect"))
    (tmp_path / "run.py").write_text(python_block(guide, "def main(num_workers)"))
    out = run_python(tmp_path, "run.py", str(workers))
    expected = documented_text_block(guide, "`python run.py` prints").splitlines()
    if workers == 2:
        text = guide.read_text()
        expected[0] = re.search(r"line lists two replies:\n`(.*?)`", text, re.S).group(1)
    assert out.splitlines() == expected


# -- schedulers guide ----------------------------------------------------------------------


def test_the_schedulers_guide_example_subclasses_an_exported_scheduler(tmp_path: Path) -> None:
    from diffusion_runtime.scheduler import RequestScheduler, StepScheduler

    assert {RequestScheduler.execution_mode, StepScheduler.execution_mode} == {"request", "step"}
    out = run_block(tmp_path, DOCS / "schedulers.md", "class FewestStepsFirst")
    assert len(out.splitlines()) == 3


def test_the_schedulers_guide_policy_example_runs(tmp_path: Path) -> None:
    run_block(tmp_path, DOCS / "schedulers.md", "class FewestRemainingStepsFirst")


def test_the_operations_guide_sleep_example_restores_exactly(tmp_path: Path) -> None:
    out = run_block(tmp_path, DOCS / "operations.md", "engine.sleep(level=2)")
    assert "asleep: [0] bytes of weights, was [5209344]" in out
    assert "bit-identical after wake: True" in out


def test_the_caching_guide_example_prints_what_it_says(tmp_path: Path) -> None:
    guide = DOCS / "caching.md"
    out = run_block(tmp_path, guide, "cache_backend=")
    assert out == documented_text_block(guide, "It prints")


def test_the_outputs_guide_rl_example_prints_what_it_says(tmp_path: Path) -> None:
    guide = DOCS / "outputs.md"
    out = run_block(tmp_path, guide, "all 8 share every step")
    assert out == documented_text_block(guide, "It prints:")


def test_the_outputs_guide_grouped_example_prints_what_it_says(tmp_path: Path) -> None:
    guide = DOCS / "outputs.md"
    out = run_block(tmp_path, guide, "group=True")
    assert out == documented_text_block(guide, "The grouped example prints:")


def test_the_outputs_guide_streaming_example_prints_what_it_says(tmp_path: Path) -> None:
    guide = DOCS / "outputs.md"
    out = run_block(tmp_path, guide, "stream_trajectory=True,")
    assert out == documented_text_block(guide, "The streaming example prints:")
