"""The runnable examples in docs/ still run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parent.parent / "docs"


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
