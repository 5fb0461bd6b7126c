"""The scripts in benchmarks/ run as ``python benchmarks/NAME.py``: the script's folder
comes first on ``sys.path``, so a script named like a standard-library module would
shadow it for everything the benchmark imports (``benchmarks/http.py`` once broke
``import torch`` in every script)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_no_benchmark_script_shadows_a_standard_library_module() -> None:
    names = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert names, "no benchmark scripts found"
    assert not names & set(sys.stdlib_module_names)


def test_each_benchmark_script_calls_its_packaged_benchmark() -> None:
    for path in BENCHMARKS.glob("*.py"):
        text = path.read_text()
        assert "from diffusion_runtime.bench." in text and '__name__ == "__main__"' in text, path
