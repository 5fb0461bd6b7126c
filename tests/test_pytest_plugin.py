"""The pytest plugin, run as a user runs it: pytest in a subprocess over a test file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).parent.parent
PLUGIN = "diffusion_runtime.testing.pytest_plugin"


def plugin_args() -> list[str]:
    """Nothing where the installed entry point loads the plugin (as for a user);
    ``-p`` where this checkout runs without being installed."""
    installed = entry_points(group="pytest11", name="diffusion_runtime")
    return [] if installed else ["-p", PLUGIN]


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args(), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_plugin_is_declared_as_a_pytest_entry_point() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r"\[project\.entry-points\.pytest11\]\n(.*?)\n", pyproject)
    assert declared is not None and declared.group(1) == f'diffusion_runtime = "{PLUGIN}"'


def test_the_auditing_guide_plugin_example_catches_the_broken_pipeline(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "auditing.md").read_text()
    example = re.search(r"```python\n(# test_with_the_plugin.py\n.*?)```", text, re.S)
    assert example is not None
    (tmp_path / "test_with_the_plugin.py").write_text(example.group(1))
    run = run_pytest(tmp_path, "--audit", "test_with_the_plugin.py")
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "1 failed, 1 passed" in output, output
    assert "output differs from the pipeline run directly" in output, output
    trace = re.search(r"^E +The failing example's trace: (\S+)$", output, re.M)
    assert trace is not None, output
    audit = run_cli(tmp_path, "audit", trace.group(1))
    assert "violations" in audit.stdout, audit.stdout + audit.stderr
    replay = re.search(r"^E +The failing example's replay file: (\S+)$", output, re.M)
    assert replay is not None, output
    rerun = run_cli(tmp_path, "audit", "--replay", replay.group(1))
    rerun_output = rerun.stdout + rerun.stderr
    assert rerun.returncode == 1, rerun_output
    # The example's rules: a wave of several requests, which the broken pipeline mixes up.
    assert re.search(r"state\.(add_burst|fill_then_add_urgent_work)\(", rerun.stdout), rerun_output
    assert "failure: AssertionError: " in rerun.stdout, rerun_output
    assert "output differs from the pipeline run directly" in rerun.stdout, rerun_output


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diffusion_runtime.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


OVERFULL = """
from diffusion_runtime import EngineConfig, SamplingParams
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler


class Overfull(RequestScheduler):
    def next_wave(self):
        return list(self.waiting.values())  # ignores max_num_seqs


def test_generate(engine_factory):
    config = EngineConfig(pipeline="testing-noise", device="cpu", max_num_seqs=2, warmup=False)
    engine = engine_factory(config, scheduler_cls=Overfull)
    outputs = engine.generate(["a", "b", "c"], SamplingParams(num_inference_steps=1))
    assert all(output.ok for output in outputs)
"""


def test_audit_fails_a_test_whose_engine_breaks_an_invariant(tmp_path: Path) -> None:
    (tmp_path / "test_overfull.py").write_text(OVERFULL)
    plain = run_pytest(tmp_path, "test_overfull.py")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    audited = run_pytest(tmp_path, "--audit", "test_overfull.py")
    output = audited.stdout + audited.stderr
    assert audited.returncode == 1, output
    assert "INV-007" in output and "max_num_seqs is 2" in output, output
