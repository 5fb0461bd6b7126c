"""The replay file: what ``diffusion-runtime audit --replay`` needs to rerun one
failing harness example against the real engine.

It holds hypothesis's own reproduction blob (the failing example's choices, as
``@reproduce_failure`` takes them), the hypothesis version that wrote it (a
blob replays only on that version), the settings that shape an example, and
how to rebuild the harness: a config factory and the harness options, each an
importable ``module:qualname`` (with the module's file, for a test module that
is not on the path); a ``lifecycle_test_case`` class in a test module; or a
harness target of :mod:`.targets` by name, with the catalogue mutation the
example ran under. A JSON file, read and checked field by field with msgspec.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import msgspec

FormatTag = Literal["diffusion-runtime-replay/1"]
FORMAT: FormatTag = "diffusion-runtime-replay/1"

#: An option the harness took as a plain value (a tolerance, a flag).
Scalar = bool | int | float | str | None


class ReplayFileError(ValueError):
    """A replay file that cannot be used; the message names the file and the field."""


class NotReplayable(Exception):
    """A failing example that no replay file can rebuild; the message says why."""


class Reference(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An importable object: ``target`` is ``module:qualname``; ``file`` is the
    module's source, which a top-level module (a test file) is loaded from, and
    a package's module only when its name does not import."""

    target: str
    file: str | None = None

    @classmethod
    def to(cls, obj: Any, field: str, homes: tuple[ModuleType, ...] = ()) -> Reference:
        """A reference that resolves to ``obj`` itself: by its own module and
        qualified name, or by a module-level name in one of ``homes``.

        Raises :class:`NotReplayable` naming ``field`` when there is none (a
        lambda, a closure, a strategy built inline in a call).
        """
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        qualname = getattr(obj, "__qualname__", None)
        if module is not None and isinstance(qualname, str) and "<" not in qualname:
            with contextlib.suppress(AttributeError):
                if _lookup(module, qualname) is obj:
                    return cls(f"{module.__name__}:{qualname}", getattr(module, "__file__", None))
        for home in homes:
            for name, value in vars(home).items():
                if value is obj and not name.startswith("__"):
                    return cls(f"{home.__name__}:{name}", getattr(home, "__file__", None))
        raise NotReplayable(
            f"{field} ({obj!r:.80}) has no importable name; define it at module level "
            "(a function, a class or a module constant, not a lambda, a closure or "
            "an inline strategy) to make the failing example replayable"
        )

    def resolve(self, field: str) -> Any:
        """The object; :class:`ReplayFileError` naming ``field`` when it does not import."""
        module_name, sep, qualname = self.target.partition(":")
        if not sep or not module_name or not qualname:
            raise ReplayFileError(f"{field}: {self.target!r} is not of the form module:qualname")
        try:
            module = _import(module_name, self.file)
            return _lookup(module, qualname)
        except Exception as exc:  # an import runs arbitrary module code
            raise ReplayFileError(
                f"{field}: {self.target!r} does not import: {type(exc).__name__}: {exc}"
            ) from None


class ReplaySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The hypothesis settings that shape an example (the step count bounds its rules)."""

    stateful_step_count: int
    derandomize: bool
    seed: int | None = None


class HarnessRecipe(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="harness"):
    """A core harness built as ``core_lifecycle_machine(target, **options)``:
    ``target`` is the config factory."""

    target: Reference
    options: dict[str, Reference | Scalar] = {}


class LifecycleTestCaseRecipe(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="test_case"
):
    """A core harness test case made by ``lifecycle_test_case``, bound to a module name."""

    target: Reference


class TargetRecipe(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="target"):
    """A harness target of :mod:`.targets` by name, in ``mode``, with the catalogue
    mutation ``mutation`` applied (``None``: the real runtime)."""

    target: str
    mode: str
    mutation: str | None = None


#: How to rebuild the harness of a replay.
Recipe = HarnessRecipe | LifecycleTestCaseRecipe | TargetRecipe


class ReplayFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One failing example, ready to rerun."""

    format: FormatTag
    hypothesis_version: str
    blob: str
    settings: ReplaySettings
    recipe: Recipe
    #: The failure as first reported, to compare with the rerun's.
    failure: str

    def write(self, path: Path) -> None:
        path.write_bytes(msgspec.json.format(msgspec.json.encode(self)))

    @classmethod
    def read(cls, path: Path) -> ReplayFile:
        """The file at ``path``; :class:`ReplayFileError` naming the field that is wrong."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ReplayFileError(
                f"cannot read the replay file {str(path)!r}: {exc.strerror}"
            ) from None
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise ReplayFileError(f"replay file {str(path)!r}: {exc}") from None


def _import(module_name: str, file: str | None) -> ModuleType:
    """The module: a top-level one (a test module) from its recorded file when
    that exists, so the file that failed is the one rerun; else by name, and
    from the file when the name does not import."""
    if file is not None and "." not in module_name and Path(file).is_file():
        # As pytest imports a test module: its folder first on the path, for its siblings.
        sys.path.insert(0, str(Path(file).parent))
        return _load_file(module_name, file)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if file is None or not (module_name == missing or module_name.startswith(missing + ".")):
            raise
    if not Path(file).is_file():
        raise ModuleNotFoundError(f"no module named {module_name!r}, and no file {file!r}")
    return _load_file(module_name, file)


def _load_file(module_name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # classes defined there must find their module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _lookup(module: ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
