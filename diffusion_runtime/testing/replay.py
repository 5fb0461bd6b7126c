"""Failing harness examples as replay files, and their reruns.

A failure report gets hypothesis's reproduction blob from the note that
``settings(print_blob=True)`` adds to the failure (or, for a flaky verdict,
which has no such note, from the failing choices a :class:`ChoiceRecorder`
saw hypothesis save), and writes it in a :class:`ReplayFile` with what
rebuilds the harness. :func:`rerun` rebuilds the harness (any target of
:mod:`.targets`, the stage included, with the mutation the example ran under)
and runs that one example through ``@reproduce_failure``: no generation, no
shrinking, the same choices against the engine as it is now.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import unittest
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import hypothesis
from hypothesis import reproduce_failure
from hypothesis import settings as Settings
from hypothesis.core import decode_failure, encode_failure
from hypothesis.database import ExampleDatabase, choices_from_bytes
from hypothesis.errors import DidNotReproduce, InvalidArgument
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.testing.core_harness import CoreLifecycleMachine, core_lifecycle_machine
from diffusion_runtime.testing.harness_root import HarnessRoot
from diffusion_runtime.testing.mutation import Patch
from diffusion_runtime.testing.profiles import harness_settings
from diffusion_runtime.testing.reach import Reach
from diffusion_runtime.testing.replay_file import (
    FORMAT,
    HarnessRecipe,
    LifecycleTestCaseRecipe,
    NotReplayable,
    Recipe,
    Reference,
    ReplayFile,
    ReplayFileError,
    ReplaySettings,
    Scalar,
    TargetRecipe,
)

#: The decorator hypothesis prints with ``print_blob=True``: version and blob.
_REPRODUCTION = re.compile(
    r"@reproduce_failure\((['\"])(?P<version>[^'\"]+)\1, b(['\"])(?P<blob>[^'\"]+)\3\)"
)


@attrs.frozen
class ReplayOutcome:
    """What one rerun of a failing example showed."""

    reproduced: bool
    #: The rules and draws of the example, as hypothesis prints them.
    steps: list[str]
    #: The failure, or why the example did not fail this time.
    message: str


class ChoiceRecorder(ExampleDatabase):
    """An example database that remembers the failing examples hypothesis saves
    in one run, passing everything on to the database the settings had (if any).

    Hypothesis saves each failing example as it finds it. When its verdict is
    "flaky" (the example did not fail again), no reproduction blob is printed,
    and the recorded choices are the only way back to the example.
    """

    def __init__(self, inner: ExampleDatabase | None) -> None:
        super().__init__()
        self._inner = inner
        self._failing: dict[bytes, None] = {}  # insertion-ordered set

    @classmethod
    def around(cls, settings: Settings) -> tuple[Settings, ChoiceRecorder]:
        """``settings`` with a recorder in front of their database."""
        recorder = cls(settings.database)
        return Settings(settings, database=recorder), recorder

    def save(self, key: bytes, value: bytes) -> None:
        if not key.endswith((b".secondary", b".pareto")):
            self._failing[value] = None
        if self._inner is not None:
            self._inner.save(key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return () if self._inner is None else self._inner.fetch(key)

    def delete(self, key: bytes, value: bytes) -> None:
        if self._inner is not None:
            self._inner.delete(key, value)

    def smallest_blob(self) -> str | None:
        """The blob of the smallest failing example saved (shrinking saves ever
        smaller ones), as ``@reproduce_failure`` takes it; ``None`` if none was."""
        recorded = [choices_from_bytes(value) for value in self._failing]
        candidates = [choices for choices in recorded if choices is not None]
        if not candidates:
            return None
        smallest = min(candidates, key=lambda choices: (len(choices), repr(choices)))
        return encode_failure(smallest).decode()


def recipe_for_harness(
    config: Callable[[], EngineConfig],
    options: dict[str, Any],
    test_module: ModuleType | None = None,
) -> HarnessRecipe:
    """How to rebuild ``core_lifecycle_machine(config, **options)``; objects are
    looked up by name in their own module, the config factory's or ``test_module``."""
    candidates = [sys.modules.get(config.__module__), test_module]
    homes = tuple(m for m in candidates if m is not None)
    recorded: dict[str, Reference | Scalar] = {}
    for name, value in options.items():
        if value is None or isinstance(value, (bool, int, float, str)):
            recorded[name] = value
        else:
            recorded[name] = Reference.to(value, f"option {name!r}", homes)
    return HarnessRecipe(Reference.to(config, "the config factory", homes), recorded)


def recipe_for_test_case(test_case: type[unittest.TestCase]) -> LifecycleTestCaseRecipe:
    """How to find ``test_case`` again: the module-level name it is bound to."""
    home = sys.modules.get(test_case.__module__)
    homes = (home,) if home is not None else ()
    return LifecycleTestCaseRecipe(Reference.to(test_case, "the test case", homes))


def record_failure(
    failure: BaseException,
    replay_dir: Path,
    recipe: Callable[[], Recipe],
    settings: Settings,
    recorder: ChoiceRecorder,
    seed: int | None = None,
) -> str:
    """Write the replay file of the example behind ``failure`` (raised with
    ``print_blob=True``, and ``recorder`` in its settings' database) in
    ``replay_dir``, named after the harness's config factory, test case or
    mutation (or target), and
    return the lines a failure report adds: how to rerun it, or why no file
    could be written. Never raises."""
    reproduction = _take_reproduction(failure)
    if reproduction is None:
        blob = recorder.smallest_blob()
        if blob is None:
            return "No replay file: hypothesis saved no failing example for this failure."
        reproduction = hypothesis.__version__, blob
    version, blob = reproduction
    try:
        harness = recipe()
    except NotReplayable as exc:
        return f"No replay file: {exc}."
    replay = ReplayFile(
        format=FORMAT,
        hypothesis_version=version,
        blob=blob,
        settings=ReplaySettings(settings.stateful_step_count, settings.derandomize, seed),
        recipe=harness,
        failure=_describe(failure),
    )
    if isinstance(harness, TargetRecipe):
        name = harness.mutation or harness.target
    else:
        name = harness.target.target.replace(":", ".")
    path = replay_dir / f"{name}.replay.json"
    try:
        replay_dir.mkdir(parents=True, exist_ok=True)
        replay.write(path)
    except OSError as exc:
        return f"No replay file: cannot write {str(path)!r}: {exc.strerror}."
    return (
        f"The failing example's replay file: {path}\n"
        f"rerun it with: diffusion-runtime audit --replay {path}"
    )


def rerun(replay: ReplayFile, trace_path: Path) -> ReplayOutcome:
    """Run the replay's example once against the code as it is now, writing its
    events to ``trace_path``.

    Raises :class:`ReplayFileError` when the file was written by another
    hypothesis version or its harness does not rebuild.
    """
    if replay.hypothesis_version != hypothesis.__version__:
        raise ReplayFileError(
            f"hypothesis_version: the replay file was written by hypothesis "
            f"{replay.hypothesis_version} and this is {hypothesis.__version__}; a blob "
            f"replays only on the version that wrote it (pip install "
            f"hypothesis=={replay.hypothesis_version})"
        )
    try:
        decode_failure(replay.blob.encode())
    except InvalidArgument as exc:
        raise ReplayFileError(f"blob: {exc}") from None
    machine, patch = _rebuild(replay.recipe)
    extra: dict[str, Any] = {"reach": Reach()}
    if issubclass(machine, CoreLifecycleMachine):  # a front harness audits its own events
        extra["trace_path"] = trace_path
    replayed = type(machine.__name__, (machine,), extra)
    reproduce_failure(replay.hypothesis_version, replay.blob.encode())(replayed)
    if replay.settings.seed is not None:
        hypothesis.seed(replay.settings.seed)(replayed)
    settings = harness_settings(
        stateful_step_count=replay.settings.stateful_step_count,
        derandomize=replay.settings.derandomize,
        database=None,
        print_blob=False,
    )
    steps: list[str] = []
    try:
        with patch, with_reporter(lambda line: steps.append(str(line))):
            run_state_machine_as_test(replayed, settings=settings)
    except DidNotReproduce as exc:
        return ReplayOutcome(False, steps, str(exc))
    except Exception as exc:
        return ReplayOutcome(True, steps, _describe(exc))
    return ReplayOutcome(False, steps, "the example passed")


def replayable_test_case(
    machine: type[HarnessRoot], module: str, replay_dir: Path
) -> type[unittest.TestCase]:
    """``machine``'s test case, named as defined in ``module``; a failure also
    writes a replay file in ``replay_dir`` (named after the test case)."""

    class ReplayableTestCase(machine.TestCase):  # type: ignore[name-defined,misc]
        #: The harness this test case runs (what a replay rebuilds).
        state_machine = machine

        def runTest(self) -> None:
            # One failing example, one replay file.
            settings, recorder = ChoiceRecorder.around(
                Settings(self.settings, print_blob=True, report_multiple_bugs=False)
            )
            try:
                run_state_machine_as_test(machine, settings=settings)
            except Exception as exc:
                test_case = type(self)
                report = record_failure(
                    exc,
                    replay_dir,
                    lambda: recipe_for_test_case(test_case),
                    settings,
                    recorder,
                    getattr(machine, "_hypothesis_internal_use_seed", None),
                )
                raise AssertionError(f"{exc}\n\n{report}") from exc

        runTest.is_hypothesis_test = True  # type: ignore[attr-defined]

    ReplayableTestCase.__module__ = module
    return ReplayableTestCase


def _rebuild(recipe: Recipe) -> tuple[type[RuleBasedStateMachine], Patch]:
    """The harness ``recipe`` names, and the patch it runs under."""
    if isinstance(recipe, TargetRecipe):
        return _rebuild_target(recipe)
    if isinstance(recipe, LifecycleTestCaseRecipe):
        test_case = recipe.target.resolve("recipe.target")
        machine = getattr(test_case, "state_machine", None)
        if not (isinstance(machine, type) and issubclass(machine, HarnessRoot)):
            raise ReplayFileError(
                f"recipe.target: {recipe.target.target!r} is not a harness test "
                "case made by lifecycle_test_case"
            )
        return machine, contextlib.nullcontext()
    config = recipe.target.resolve("recipe.target")
    options: dict[str, Any] = {
        name: value.resolve(f"recipe.options.{name}") if isinstance(value, Reference) else value
        for name, value in recipe.options.items()
    }
    try:
        inspect.signature(core_lifecycle_machine).bind(config, **options)
    except TypeError as exc:
        raise ReplayFileError(f"recipe.options: {exc}") from None
    return core_lifecycle_machine(config, **options), contextlib.nullcontext()


def _rebuild_target(recipe: TargetRecipe) -> tuple[type[RuleBasedStateMachine], Patch]:
    # Imported here: the targets build harnesses, whose module imports this one.
    from diffusion_runtime.testing.mutations import named
    from diffusion_runtime.testing.targets import HARNESSES, harness_for

    if recipe.target not in HARNESSES:
        raise ReplayFileError(
            f"recipe.target: {recipe.target!r} is not a harness target ({sorted(HARNESSES)})"
        )
    if recipe.mutation is None:
        return harness_for(recipe.target, recipe.mode), contextlib.nullcontext()
    try:
        mutation = named(recipe.mutation)
    except KeyError as exc:
        raise ReplayFileError(f"recipe.mutation: {exc.args[0]}") from None
    return harness_for(recipe.target, recipe.mode), mutation.patch()


def _take_reproduction(failure: BaseException) -> tuple[str, str] | None:
    """The (version, blob) hypothesis noted on ``failure``. The note is removed:
    it says to decorate a test function, which a harness run does not have."""
    notes: list[str] = getattr(failure, "__notes__", [])
    for note in notes:
        found = _REPRODUCTION.search(note)
        if found is not None:
            notes.remove(note)
            return found.group("version"), found.group("blob")
    return None


def _describe(failure: BaseException) -> str:
    first_line = str(failure).partition("\n")[0]
    return f"{type(failure).__name__}: {first_line}"
