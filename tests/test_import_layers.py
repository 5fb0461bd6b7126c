"""The package's dependencies point one way: the import-linter contract in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))"
)


def test_layers_import_downwards_only() -> None:
    # In a process of its own: import-linter configures logging with dictConfig,
    # which disables every logger that exists, and later tests of this process
    # that read the runtime's log records would see none.
    linted = subprocess.run(
        [sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr
