"""Which pod serves a request: the adapter's rendezvous ranking, residency and a load bound (pure, no I/O).

An adapter's home is the first `width` pods of its ranking (the pods the operator places it on). Among the pods
under the load bound, a home pod that holds the adapter comes first (device, then host, then disk; a pod this
router just sent it to counts as host), then any pod that holds it, then the home pods, then the rest in
ranking order (an adapter overflowing its home thus loads on one more pod, not on several while the residency
it polls catches up). A spilled adapter's home pods take it least loaded first, holding it or not (that is
what widening it is for), a pod that would have to load it counted `MISS_COST` requests busier.

A pod is under the bound when one more request keeps it within (1 + epsilon) x the mean. When no pod is
under, the least loaded come first, so some pod always takes the request. The order past the first pick is where a
request goes if the first pod cannot be reached. `Spill` widens a hot adapter's home to the next pods in its
ranking and narrows it back.

A pool that cannot load an adapter on demand (vLLM pods answer 404 for one they were not loaded with): while
some pod holds the adapter, only the pods holding it are in the order, as above among themselves (a widened
home thus spreads over the home pods that hold it, never onto one without it); while none holds it, every pod
is, as above (the first answers its 404).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplane_server.serving.router.ranking import rank

# any other tier (source, none): not resident; loaded: a vLLM pod's adapter, in memory (vLLM does not say where)
TIER_ORDER = {"device": 0, "host": 1, "loaded": 1, "disk": 2}


@dataclass
class PodView:
    """What the router knows of one Ready pod: its residency (adapter id -> tier) and load."""

    name: str
    url: str
    residency: Mapping[str, str] = field(default_factory=dict)
    queued: int = 0  # waiting + running, as its /metrics said at the last poll
    in_flight: int = 0  # this router's requests on it now
    others: int = 0  # requests other routers (and direct clients) had on it at the last poll
    pending: dict[str, float] = field(default_factory=dict)  # adapters sent here while not resident -> when

    def holds(self, adapter_id: str) -> bool:
        """Resident, or loading because this router sent it a request for the adapter since the last poll."""
        return self.tier_of(adapter_id) < 3 or adapter_id in self.pending

    def rank_of(self, adapter_id: str | None) -> int:
        """tier_of, with an adapter this router sent here and not yet seen in memory counted as on the host."""
        tier = self.tier_of(adapter_id)
        return 1 if tier >= 2 and adapter_id in self.pending else tier

    @property
    def load(self) -> int:
        """This router's requests now plus everyone else's at the last poll."""
        return self.in_flight + self.others

    def tier_of(self, adapter_id: str | None) -> int:
        """0 device, 1 host, 2 disk, 3 not resident (the base model is on every pod: 0)."""
        if adapter_id is None:
            return 0
        return TIER_ORDER.get(self.residency.get(adapter_id, ""), 3)


MISS_COST = 2  # a spilled adapter's home pod without it in memory counts as this many requests busier (the load)
MIN_BOUND = 2  # a pod holding fewer requests than this is never over the bound


def load_bound(pods: Sequence[PodView], epsilon: float, floor: int = MIN_BOUND) -> float:
    """The most requests a pod may hold with this one counted: (1 + epsilon) x the mean load with this request
    counted, as in consistent hashing with bounded loads. Not rounded up: with a handful of requests on a few
    pods the rounding alone would let a hot adapter's pod hold 1.5x the mean. While the pool holds no more
    requests than it has pods, never under `floor`: at such a load (one request on 3 pods: a bound of 0.4)
    affinity is worth more than spreading, as a pod batches a second request for little more than the cost of
    one, and the load a poll read can be a second old."""
    total = sum(p.load for p in pods) + 1
    bound = (1 + epsilon) * total / max(len(pods), 1)
    return max(1.0, bound, float(floor) if total <= len(pods) else 0.0)


def choose(
    adapter_id: str | None,
    pods: Sequence[PodView],
    width: int,
    epsilon: float,
    floor: int = MIN_BOUND,
    on_demand: bool = True,
) -> list[PodView]:
    """Every pod, best first, for one request for `adapter_id` (None: the base model, least loaded first);
    `on_demand` False: only the pods holding the adapter, when any does (the pods cannot load it)."""
    if not pods:
        return []
    if adapter_id is None:
        return sorted(pods, key=lambda p: (p.load, p.name))
    ranked = pods_by_rank(adapter_id, pods)
    home = {p.name for p in ranked[: max(width, 1)]}
    bound = load_bound(pods, epsilon, floor)

    spilled = width > 1

    def key(item: tuple[int, PodView]) -> tuple[bool, int, int, int, int, int, int]:
        position, pod = item
        if pod.load + 1 > bound:  # over: after every pod under the bound, the least loaded first
            return (True, pod.load, 0, 0, 0, 0, position)
        held, is_home = pod.holds(adapter_id), pod.name in home
        group = (0 if held or spilled else 2) if is_home else (1 if held else 3)
        # a spilled adapter's home pods (all of them, holding it or not) the least loaded first, a pod without it
        # in memory counted MISS_COST requests busier; otherwise the pods holding it in memory first, then the
        # ranking
        spread = pod.load + (MISS_COST if pod.rank_of(adapter_id) > 1 else 0) if spilled and is_home else 0
        return (False, 0, group, spread, pod.rank_of(adapter_id), pod.load if is_home else 0, position)

    order = [pod for _, pod in sorted(enumerate(ranked), key=key)]
    if not on_demand and any(p.holds(adapter_id) for p in order):
        order = [p for p in order if p.holds(adapter_id)]
    return order


@dataclass
class Spill:
    """Per-adapter home width: one more pod of its ranking while its home pods are all at `queue_threshold`
    requests or more (at most one step per `step_s`), one fewer once they have all stayed under half of it
    for `settle_s`. Adapters at width 1 are not stored."""

    queue_threshold: int = 8
    step_s: float = 2.0
    settle_s: float = 10.0
    widths: dict[str, int] = field(default_factory=dict)
    _changed: dict[str, float] = field(default_factory=dict)
    _calm_since: dict[str, float] = field(default_factory=dict)
    spills: int = 0  # widenings so far (a metric)

    def width(self, adapter_id: str) -> int:
        return self.widths.get(adapter_id, 1)

    def observe(self, adapter_id: str, pods: Sequence[PodView], now: float) -> int:
        """Update the adapter's width from its home pods' load now; the width to route with."""
        width = self.width(adapter_id)
        home = pods_by_rank(adapter_id, pods)[:width]
        if not home:
            return width
        if all(p.load >= self.queue_threshold for p in home):
            self._calm_since.pop(adapter_id, None)
            if width < len(pods) and now - self._changed.get(adapter_id, -math.inf) >= self.step_s:
                self._set(adapter_id, width + 1, now)
                self.spills += 1
        elif width > 1 and all(p.load < self.queue_threshold / 2 for p in home):
            since = self._calm_since.setdefault(adapter_id, now)
            if now - since >= self.settle_s:
                self._set(adapter_id, width - 1, now)
                self._calm_since[adapter_id] = now
        else:
            self._calm_since.pop(adapter_id, None)
        return self.width(adapter_id)

    def _set(self, adapter_id: str, width: int, now: float) -> None:
        self._changed[adapter_id] = now
        if width <= 1:
            self.widths.pop(adapter_id, None)
            self._calm_since.pop(adapter_id, None)
        else:
            self.widths[adapter_id] = width


def pods_by_rank(adapter_id: str, pods: Sequence[PodView]) -> list[PodView]:
    by_name = {p.name: p for p in pods}
    return [by_name[n] for n in rank(adapter_id, by_name)]
