"""The hypothesis settings of every harness run, built in one place.

A profile is a named set of settings; :func:`harness_settings` builds one with
any changes over it, and :func:`register_profiles` registers them all with
hypothesis (``HYPOTHESIS_PROFILE=thorough`` then picks one for a test suite).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase
from hypothesis import settings as Settings

_CI: dict[str, Any] = {
    "max_examples": 50,
    "stateful_step_count": 20,
    "deadline": None,  # an example builds engines, threads and processes
    "suppress_health_check": [HealthCheck.too_slow],
}
_HARNESS: dict[str, Any] = {
    **_CI,
    "suppress_health_check": list(HealthCheck),
    "derandomize": True,
    "phases": [Phase.generate, Phase.shrink],
    "print_blob": True,  # a replay file holds the blob
    "report_multiple_bugs": False,  # one failing example, one replay file
}

#: Each profile's settings: ``ci`` (the test suite's default: fast), ``thorough``
#: (more and longer examples), ``harness`` (a harness run that reports a failure:
#: derandomized, shrunk, one failing example and its blob) and ``hunt`` (a
#: mutation hunt: the same examples every time, no shrinking, no example database).
PROFILES: dict[str, dict[str, Any]] = {
    "ci": _CI,
    "thorough": {**_CI, "max_examples": 500, "stateful_step_count": 60},
    "harness": _HARNESS,
    "hunt": {**_HARNESS, "max_examples": 60, "phases": [Phase.generate], "database": None},
}


def harness_settings(profile: str = "harness", **changes: Any) -> Settings:
    """The settings of ``profile`` (a key of :data:`PROFILES`), with ``changes``
    (hypothesis setting names) over them."""
    return Settings(**{**PROFILES[profile], **changes})


def register_profiles() -> None:
    """Register every profile of :data:`PROFILES` with hypothesis, under its name."""
    for name in PROFILES:
        Settings.register_profile(name, harness_settings(name))
