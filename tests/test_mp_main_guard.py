"""An mp engine created at a script's top level, without the main-module guard.

Under 'spawn' each worker imports the main module again; the engine created
there must not start workers of its own, and the user must learn the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

ENGINE = (
    "DiffusionEngine.make_engine(EngineConfig(pipeline='testing-noise', device='cpu', "
    "executor_backend='mp', warmup=False)).close()"
)
IMPORTS = "from diffusion_runtime import DiffusionEngine, EngineConfig\n"


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "script.py").write_text(IMPORTS + body)
    return subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unguarded_main_module_is_told_to_add_the_guard(tmp_path: Path) -> None:
    run = run_script(tmp_path, f"{ENGINE}\nprint('started')\n")
    assert run.returncode == 1
    assert "started" not in run.stdout
    failure = run.stderr.splitlines()[-1]  # the exception the script died of
    assert failure.startswith("diffusion_runtime.executor.mp.group.WorkerStartError: worker 0 ")
    assert f"exited with code {os.EX_CONFIG} during start-up" in failure
    assert 'under `if __name__ == "__main__":`' in failure
    # The worker said why too, once: it started no workers of its own.
    assert run.stderr.count("diffusion-runtime: worker processes are started with 'spawn'") == 1


def test_the_guarded_script_starts(tmp_path: Path) -> None:
    run = run_script(tmp_path, f"if __name__ == '__main__':\n    {ENGINE}\n    print('started')\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "started\n"
