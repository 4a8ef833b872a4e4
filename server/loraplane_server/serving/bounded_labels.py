"""A bounded set of Prometheus label values: per-adapter series that cannot grow without limit.

At most `max_labels` labels have their own series; everything else is counted under OTHER. A label whose
lifetime weight (tokens, requests: the caller's) outgrows the smallest labelled one takes its place; the one
it displaces stops being exported (its series goes stale) and resumes from its last value if it comes back.
So every series only ever grows, and Prometheus' rate() and increase() stay right across swaps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

OTHER = "__other__"

V = TypeVar("V")


class BoundedLabels(Generic[V]):
    """Label -> a mutable value (made by `new`), `max_labels` labels at most, the rest in one OTHER value."""

    def __init__(self, max_labels: int, new: Callable[[], V]) -> None:
        self.max_labels = max_labels
        self.new = new
        self.labelled: dict[str, V] = {}
        self.retired: dict[str, V] = {}  # displaced labels' last exported values
        self.lifetime: dict[str, int] = {}  # label -> all its weight ever, for ranking
        self.other = new()

    def value(self, label: str, weight: int) -> V:
        """The value to add one event of `label` to: its own, or OTHER's. `weight` counts toward its rank."""
        self.lifetime[label] = self.lifetime.get(label, 0) + weight
        if label in self.labelled or self._promote(label):
            return self.labelled[label]
        return self.other

    def _promote(self, label: str) -> bool:
        if len(self.labelled) >= self.max_labels:
            smallest = min(self.labelled, key=lambda a: self.lifetime[a])
            if self.lifetime[smallest] >= self.lifetime[label]:
                return False
            self.retired[smallest] = self.labelled.pop(smallest)
        self.labelled[label] = self.retired.pop(label) if label in self.retired else self.new()
        return True

    def series(self) -> list[tuple[str, V]]:
        """(label, value) pairs to export; OTHER only once something has been counted there."""
        rows = sorted(self.labelled.items())
        if self.other != self.new():
            rows.append((OTHER, self.other))
        return rows

    def values(self) -> Iterator[V]:
        """Every value ever counted into: labelled, retired and OTHER (for totals over all labels)."""
        yield from self.labelled.values()
        yield from self.retired.values()
        yield self.other
