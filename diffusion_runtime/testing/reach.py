"""Measured reach: which rules and runtime paths a harness run exercised, and how often."""

from __future__ import annotations

from collections import Counter

from hypothesis import event


class Reach:
    """Counts the paths a harness reaches, across every example of a run.

    Each :meth:`note` also becomes a hypothesis ``event()``, so
    ``pytest --hypothesis-show-statistics`` lists the same counts per test.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def note(self, path: str) -> None:
        self.counts[path] += 1
        event(path)

    def missing(self, required: dict[str, int]) -> dict[str, int]:
        """The paths in ``required`` reached fewer times than asked, with their counts."""
        return {
            path: self.counts[path] for path, least in required.items() if self.counts[path] < least
        }

    def table(self) -> str:
        """A Markdown table of every path reached, most frequent first."""
        rows = [f"| {path} | {count} |" for path, count in self.counts.most_common()]
        return "\n".join(["| path | times reached |", "|---|---|", *rows])
