"""The router's Prometheus metrics: requests per pod and residency tier, per adapter (a bounded label set),
the routed-to-resident ratio, spills and each spilled adapter's home width, retries, failures and the
pods' time to response headers.

Per-adapter series are bounded like the server's token usage (loraplane_server.serving.bounded_labels): at most
`max_labels` adapters have their own series (the busiest by lifetime requests), the rest count under OTHER; a
displaced adapter's series goes stale and resumes from its last value when it comes back, so every series only
grows. A pod's series are removed once the pod has been out of the pool for `POD_SERIES_TTL_S` (pods are
replaced with new names).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplane_server.serving.bounded_labels import OTHER, BoundedLabels

# the tier the request's adapter had on its pod when routed (loaded: on a vLLM pod, which does not say where)
TIERS = ("device", "host", "disk", "loaded", "none", "base")
RESIDENT_TIERS = frozenset({"device", "host", "disk", "loaded"})
POD_SERIES_TTL_S = 300.0
FAILURE_REASONS = ("unreachable", "no_ready_pod", "hold_full", "hold_timeout")  # serving/router/app.py's
HELD_METRIC = "loraplane_router_held_requests"  # the operator's ScaledObject wakes a pool at zero on it


@dataclass
class AdapterCount:
    requests: int = 0
    resident: int = 0


class AdapterCounts(BoundedLabels[AdapterCount]):
    """Requests per adapter (and how many went to a pod that held it), `max_labels` adapters at most."""

    def __init__(self, max_labels: int) -> None:
        super().__init__(max_labels, AdapterCount)

    def record(self, adapter: str, resident: bool) -> None:
        count = self.value(adapter, 1)
        count.requests += 1
        count.resident += int(resident)


class RouterMetrics:
    def __init__(self, max_adapter_labels: int = 64) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraplane_router_requests",
            "Requests routed, by pod and the adapter's tier on it when routed (none: not resident; base: no adapter)",
            ["pod", "tier"],
            registry=r,
        )
        self.retries = Counter("loraplane_router_retries", "Pods skipped before the first byte", registry=r)
        self.failures = Counter("loraplane_router_failures", "Requests no pod could take", ["reason"], registry=r)
        for reason in FAILURE_REASONS:  # every series from the start, at 0: a rate() alert sees the first one
            self.failures.labels(reason)
        self.spills = Counter("loraplane_router_spills", "Adapter homes widened to one more pod", registry=r)
        self.upstream = Histogram(
            "loraplane_router_upstream_seconds", "Time to the pod's response headers", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )  # fmt: skip
        self.held = Histogram(
            "loraplane_router_held_seconds", "Time a request waited for a Ready server pod (held, then routed)",
            registry=r, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
        )  # fmt: skip
        self.adapters = AdapterCounts(max_adapter_labels)
        self.pod_seen: dict[str, float] = {}

    def routed(self, pod: str, adapter_id: str | None, tier: str) -> None:
        self.requests.labels(pod, tier).inc()
        self.pod_seen[pod] = time.monotonic()
        if adapter_id is not None:
            self.adapters.record(adapter_id, tier in RESIDENT_TIERS)

    def pods_now(self, names: list[str], now: float | None = None) -> None:
        """The pool's pods at a poll: series of pods gone for longer than POD_SERIES_TTL_S are removed."""
        now = time.monotonic() if now is None else now
        for name in names:
            self.pod_seen[name] = now
        for name, seen in list(self.pod_seen.items()):
            if now - seen > POD_SERIES_TTL_S:
                del self.pod_seen[name]
                for tier in TIERS:
                    try:
                        self.requests.remove(name, tier)
                    except KeyError:
                        pass

    def watch_pool(
        self, pods: Callable[[], int], widths: Callable[[], Mapping[str, int]], held: Callable[[], int] = lambda: 0
    ) -> None:
        """Scrape-time gauges: Ready pods, requests held for one, spilled adapters' home widths, the per-adapter
        series."""
        self.registry.register(_ScrapeTime(self, pods, widths, held))


class _ScrapeTime(Collector):
    def __init__(
        self,
        metrics: RouterMetrics,
        pods: Callable[[], int],
        widths: Callable[[], Mapping[str, int]],
        held: Callable[[], int],
    ) -> None:
        self.metrics, self.pods, self.widths, self.held = metrics, pods, widths, held

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("loraplane_router_pods", "Ready server pods in the pool", value=self.pods())
        yield GaugeMetricFamily(
            HELD_METRIC,
            "Requests waiting for a Ready server pod (a pool at zero wakes on it)",
            value=self.held(),
        )
        width = GaugeMetricFamily(
            "loraplane_router_adapter_home_width",
            "Pods in a spilled adapter's home (adapters at width 1 have no series)",
            labels=["adapter"],
        )
        for adapter, w in sorted(self.widths().items())[: self.metrics.adapters.max_labels]:
            width.add_metric([adapter], w)
        yield width
        requests = CounterMetricFamily(
            "loraplane_router_adapter_requests",
            f"Requests routed per adapter (the busiest adapters; the rest as {OTHER})",
            labels=["adapter"],
        )
        resident = CounterMetricFamily(
            "loraplane_router_adapter_resident_requests",
            "Requests routed per adapter to a pod that held it (device, host or disk)",
            labels=["adapter"],
        )
        for adapter, count in self.metrics.adapters.series():
            requests.add_metric([adapter], count.requests)
            resident.add_metric([adapter], count.resident)
        counts = list(self.metrics.adapters.values())
        total, hits = sum(c.requests for c in counts), sum(c.resident for c in counts)
        yield requests
        yield resident
        yield GaugeMetricFamily(
            "loraplane_router_resident_ratio",
            "Of the adapter requests routed since start, the share sent to a pod that held the adapter",
            value=hits / total if total else 0.0,
        )
