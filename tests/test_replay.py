"""Replay files: written by a failing harness run as a user runs it (pytest in a
subprocess, with the plugin), rerun by ``diffusion-runtime audit --replay``, and
refused with one ``error:`` line when they cannot be used.

The plugin's ``lifecycle_harness`` replay of the docs example is rerun in a
separate process in ``test_pytest_plugin.py``; here the reruns go through the
command line's ``main`` in this process, which is faster.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis.core import encode_failure
from hypothesis.database import InMemoryExampleDatabase, choices_to_bytes
from test_pytest_plugin import run_pytest

from diffusion_runtime import EngineConfig
from diffusion_runtime.cli import main
from diffusion_runtime.scheduler.request import Request
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.testing.mutations import CATALOGUE, named
from diffusion_runtime.testing.pytest_plugin import LifecycleHarness
from diffusion_runtime.testing.replay import ChoiceRecorder
from diffusion_runtime.testing.replay_file import ReplayFile

OVERFULL_MODULE = "test_overfull_replay"

OVERFULL = """
from pathlib import Path

from hypothesis import Phase, settings

from diffusion_runtime import EngineConfig
from diffusion_runtime.scheduler.request_scheduler import RequestScheduler
from diffusion_runtime.testing import lifecycle_test_case


class Overfull(RequestScheduler):
    def next_wave(self):
        return list(self.waiting.values())  # ignores max_num_seqs


def config():
    return EngineConfig(pipeline="testing-noise", device="cpu", max_num_seqs=2, warmup=False)


TestOverfull = lifecycle_test_case(
    config,
    scheduler_cls=Overfull,
    replay_dir=Path(__file__).parent / "replays",
    settings=settings(
        max_examples=20,
        stateful_step_count=10,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate, Phase.shrink],
    ),
)

"""


@pytest.fixture
def test_module_unloaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A replay loads the test module it names: keep it out of this process's
    modules and path once the test is done."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop(OVERFULL_MODULE, None)


def audit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["audit", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_failing_test_case_replays_until_its_bug_is_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], test_module_unloaded: None
) -> None:
    module = tmp_path / f"{OVERFULL_MODULE}.py"
    module.write_text(OVERFULL)
    run = run_pytest(tmp_path, f"{module.name}")
    output = run.stdout + run.stderr
    assert "1 failed" in output, output
    replay = tmp_path / "replays" / f"{OVERFULL_MODULE}.TestOverfull.replay.json"
    assert f"rerun it with: diffusion-runtime audit --replay {replay}" in output, output
    recorded = json.loads(replay.read_text())
    assert recorded["recipe"] == {
        "type": "test_case",
        "target": {"target": f"{OVERFULL_MODULE}:TestOverfull", "file": str(module)},
    }
    assert recorded["settings"] == {"stateful_step_count": 10, "derandomize": True, "seed": None}

    trace, drawing = tmp_path / "replay.jsonl", tmp_path / "replay.json"
    code, out, err = audit(
        capsys, "--replay", str(replay), "--trace", str(trace), "--perfetto", str(drawing)
    )
    assert code == 1, out + err
    assert "state = ConfiguredCoreLifecycle()" in out, out
    assert "failure: AssertionError: INV-007" in out, out
    assert "INV-007 " in out and "{'kind': 'wave'" in out, out  # describe()
    assert re.search(rf"\(INV-007: \d+\) in the replayed trace {re.escape(str(trace))}", out), out
    assert trace.read_text().count("\n") > 3
    instants = [e["name"] for e in json.loads(drawing.read_text())["traceEvents"]]
    assert "INV-007 violated" in instants

    fixed = "return super().next_wave()"
    module.write_text(OVERFULL.replace("return list(self.waiting.values())", fixed))
    code, out, err = audit(capsys, "--replay", str(replay))
    assert code == 0, out + err
    assert "did not reproduce: " in out and "first reported: AssertionError: INV-007" in out


def test_a_failing_front_test_case_replays_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], test_module_unloaded: None
) -> None:
    """The threaded front harness writes a replay file like the core's, and the
    replay reruns the front harness with the same draws."""
    module = tmp_path / f"{OVERFULL_MODULE}.py"
    module.write_text(
        OVERFULL.replace(
            "    scheduler_cls=Overfull,", '    target="front",\n    scheduler_cls=Overfull,'
        )
    )
    run = run_pytest(tmp_path, f"{module.name}")
    output = run.stdout + run.stderr
    assert "1 failed" in output, output
    replay = tmp_path / "replays" / f"{OVERFULL_MODULE}.TestOverfull.replay.json"
    assert f"rerun it with: diffusion-runtime audit --replay {replay}" in output, output
    code, out, err = audit(capsys, "--replay", str(replay))
    assert code == 1, out + err
    assert "state = ConfiguredLifecycle()" in out, out
    assert "failure: AssertionError: INV-007" in out, out


FLAKY = """
import itertools
from pathlib import Path

from hypothesis import settings
from hypothesis.stateful import rule

from diffusion_runtime import EngineConfig
from diffusion_runtime.testing import lifecycle_test_case
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine

calls = itertools.count()


class FailsOnce(CoreLifecycleMachine):
    @rule()
    def fails_on_the_fourth_call_only(self):
        assert next(calls) != 3, "the fourth call"


def config():
    return EngineConfig(pipeline="testing-noise", device="cpu", warmup=False)


TestFlaky = lifecycle_test_case(
    config,
    base=FailsOnce,
    replay_dir=Path(__file__).parent / "replays",
    settings=settings(max_examples=5, stateful_step_count=5, deadline=None, database=None),
)
"""


def test_a_flaky_verdict_fails_the_test_with_a_replay_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure hypothesis cannot reproduce is reported, never retried away. For
    this verdict hypothesis prints no reproduction blob; the replay file is made
    from the failing example hypothesis saved, and it reruns."""
    module = tmp_path / "test_flaky_harness.py"
    module.write_text(FLAKY)
    run = run_pytest(tmp_path, module.name)
    output = run.stdout + run.stderr
    assert "1 failed" in output and "Inconsistent results" in output, output
    replay = tmp_path / "replays" / "test_flaky_harness.TestFlaky.replay.json"
    assert f"rerun it with: diffusion-runtime audit --replay {replay}" in output, output
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "test_flaky_harness", raising=False)
    code, out, err = audit(capsys, "--replay", str(replay))
    sys.modules.pop("test_flaky_harness", None)
    assert code in (0, 1), out + err
    assert "state = " in out, out  # the example's steps, replayed


class Overfull(RequestScheduler):
    """A bug: waves ignore ``max_num_seqs``."""

    def next_wave(self) -> list[Request]:
        return list(self.waiting.values())


def test_a_failure_whose_config_factory_has_no_name_reports_why_it_has_no_replay_file(
    lifecycle_harness: LifecycleHarness,
) -> None:
    def config() -> EngineConfig:
        return EngineConfig(pipeline="testing-noise", device="cpu", max_num_seqs=2, warmup=False)

    with pytest.raises(AssertionError) as failure:
        lifecycle_harness(config, scheduler_cls=Overfull, max_examples=20, steps=10)
    report = str(failure.value)
    assert "INV-007" in report and "The failing example's trace: " in report, report
    assert "No replay file: the config factory (<function " in report, report
    assert "has no importable name; define it at module level" in report, report


@pytest.mark.parametrize(
    "name",
    [
        "dropped-consumer-not-aborted",  # front, step mode
        "stage-exit-skips-core-shutdown",  # stage, request mode: a bug in the stage process
    ],
)
def test_a_hunted_mutation_replays_on_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """``diffusion-runtime hunt NAME`` catches the mutation on its own target and
    writes the failing example's replay file; ``audit --replay`` reruns it on the
    same target, the mutation applied: the same failure. Without the mutation
    the example passes."""
    code = main(["hunt", name, "--examples", "10", "--replay-dir", str(tmp_path)])
    out = capsys.readouterr().out
    replay = tmp_path / f"{name}.replay.json"
    assert code == 0 and f"rerun it with: diffusion-runtime audit --replay {replay}" in out, out
    mutation = named(name)
    recipe = {"type": "target", "target": mutation.target, "mode": mutation.mode, "mutation": name}
    assert json.loads(replay.read_text())["recipe"] == recipe
    code, out, err = audit(capsys, "--replay", str(replay))
    assert code == 1, out + err
    [failure] = re.findall(r"^failure: (.*)$", out, re.M)
    assert same_rule(failure, ReplayFile.read(replay).failure), out
    if mutation.target == "front":
        recipe["mutation"] = None
        replay.write_text(json.dumps({**json.loads(replay.read_text()), "recipe": recipe}))
        code, out, err = audit(capsys, "--replay", str(replay))
        assert code == 0 and "did not reproduce: " in out, out + err


def test_hunt_lists_the_catalogue_and_refuses_an_unknown_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["hunt"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(CATALOGUE)
    assert "stage-exit-skips-core-shutdown (stage, request): " in "\n".join(listed)
    assert main(["hunt", "no-such-bug"]) == 2
    assert "error: no mutation named 'no-such-bug'" in capsys.readouterr().err


def same_rule(one: str, other: str) -> bool:
    """Whether two failures break the same rule. A front runs its engine on a thread, so
    which request a replay finds breaking the rule first (its id, its end state, its
    transitions) may differ from the recorded run; the rule's words may not."""

    def masked(failure: str) -> str:
        failure = re.sub(r"'[0-9a-f]{8}-\d+'", "'ID'", failure)
        failure = re.sub(r"\bFINISHED_[A-Z]+\b", "STATUS", failure)
        return re.sub(r"\[[^\]]*\]", "[...]", failure)

    return masked(one) == masked(other)


def replay_file(tmp_path: Path, **changes: Any) -> Path:
    fields: dict[str, Any] = {
        "format": "diffusion-runtime-replay/1",
        "hypothesis_version": hypothesis.__version__,
        "blob": "AXicY2BgYAAAAAQAAQ==",
        "settings": {"stateful_step_count": 10, "derandomize": True},
        "recipe": {"type": "harness", "target": {"target": "tests_nowhere:config"}},
        "failure": "AssertionError: recorded",
    }
    fields.update(changes)
    path = tmp_path / "example.replay.json"
    path.write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"hypothesis_version": "6.0.0"},
            "hypothesis_version: the replay file was written by hypothesis 6.0.0 and this is",
        ),
        ({"blob": None}, "Object missing required field `blob`"),
        ({"blob": "not base64!"}, "blob: Invalid base64 encoded string"),
        ({"settings": {"stateful_step_count": "ten", "derandomize": True}}, "$.settings"),
        ({"format": "other/1"}, "`$.format`"),
        (
            {},
            "recipe.target: 'tests_nowhere:config' does not import: "
            "ModuleNotFoundError: No module named 'tests_nowhere'",
        ),
        (
            {"recipe": {"type": "test_case", "target": {"target": "os:getcwd"}}},
            "recipe.target: 'os:getcwd' is not a harness test case",
        ),
        (
            {
                "recipe": {
                    "type": "harness",
                    "target": {"target": "os:getcwd"},
                    "options": {"colour": 3},
                }
            },
            "recipe.options: got an unexpected keyword argument 'colour'",
        ),
        (
            {"recipe": {"type": "target", "target": "nowhere", "mode": "step"}},
            "recipe.target: 'nowhere' is not a harness target",
        ),
        (
            {"recipe": {"type": "target", "target": "core", "mode": "step", "mutation": "x"}},
            "recipe.mutation: no mutation named 'x' in the catalogue",
        ),
    ],
)
def test_a_replay_file_that_cannot_be_used_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], message: str
) -> None:
    code, out, err = audit(capsys, "--replay", str(replay_file(tmp_path, **changes)))
    assert code == 2, out + err
    [line] = err.splitlines()
    assert line.startswith("error: ") and message in line, line
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "audit takes a TRACE to check or --replay FILE to rerun"),
        (("run.jsonl", "--replay", "x.json"), "audit takes a TRACE to check or --replay FILE"),
        (("run.jsonl", "--trace", "out.jsonl"), "--trace OUT.jsonl goes with --replay FILE"),
        (("--replay", "missing.json"), "cannot read the replay file 'missing.json'"),
    ],
)
def test_audit_options_that_do_not_fit_are_refused(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, out, err = audit(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in out + err, out + err


def test_the_choice_recorder_keeps_the_users_database_whole() -> None:
    """A harness run records failing examples without taking the user's database
    away: saves, fetches and deletes reach it; secondary entries are not failures."""
    users = InMemoryExampleDatabase()
    recorder = ChoiceRecorder(users)
    small, large = choices_to_bytes([1]), choices_to_bytes([1, 2, 3])
    recorder.save(b"key", large)
    recorder.save(b"key", small)
    recorder.save(b"key.secondary", choices_to_bytes([]))
    assert set(recorder.fetch(b"key")) == {small, large}
    recorder.delete(b"key", large)
    assert list(users.fetch(b"key")) == [small]
    assert recorder.smallest_blob() == encode_failure([1]).decode()
    assert ChoiceRecorder(None).smallest_blob() is None
