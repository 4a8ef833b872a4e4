"""The operator's Prometheus metrics, served on their own port (`loraplane operator --metrics-port`, 8081 in the
chart): reconciles and their errors and durations per kind, admin calls per pod and outcome, adapters per
phase, retries. prometheus-client's own registry and HTTP server, not hand-written exposition.

Labels stay bounded: kind is one of two, outcome one of four, phase one of five; `pod` is a server pod's
address (as many as there are server pods).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane_operator import constants as c

REGISTRY = CollectorRegistry(auto_describe=True)
KINDS = (c.BMS_KIND, c.LORA_KIND)
PHASES = (c.PHASE_PENDING, c.PHASE_LOADING, c.PHASE_READY, c.PHASE_DEGRADED, c.PHASE_FAILED)

RECONCILES = Counter(
    "loraplane_operator_reconciles_total",
    "Reconciles run, by kind and result (ok, error).",
    ["kind", "result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "loraplane_operator_reconcile_duration_seconds",
    "Wall time of one reconcile (a BaseModelServer's apply, a LoRAAdapter's round).",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)
ADMIN_CALLS = Counter(
    "loraplane_operator_admin_calls_total",
    "Calls to the server pods' admin API, by pod address and outcome (ok, client_error, server_error, unreachable).",
    ["pod", "outcome"],
    registry=REGISTRY,
)
RETRIES = Counter(
    "loraplane_operator_retries_total",
    "Reconciles that ended in a retry with backoff (a transient failure), by kind.",
    ["kind"],
    registry=REGISTRY,
)
for _kind in KINDS:  # every series exists from the start, at 0
    for _result in ("ok", "error"):
        RECONCILES.labels(_kind, _result)
    RETRIES.labels(_kind)


class AdapterPhases(Collector):
    """loraplane_operator_adapters{namespace, phase}: the adapters' phases as the operator last wrote them."""

    def __init__(self) -> None:
        self.phases: dict[tuple[str, str], str] = {}  # (namespace, name) -> phase

    def set(self, namespace: str, name: str, phase: str | None) -> None:
        if phase is None:
            self.phases.pop((namespace, name), None)
        else:
            self.phases[(namespace, name)] = phase

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "loraplane_operator_adapters", "LoRAAdapters by namespace and phase.", labels=["namespace", "phase"]
        )
        counts: dict[tuple[str, str], int] = {}
        for (namespace, _), phase in self.phases.items():
            counts[(namespace, phase)] = counts.get((namespace, phase), 0) + 1
        for namespace in sorted({ns for ns, _ in counts}):
            for phase in PHASES:
                family.add_metric([namespace, phase], counts.get((namespace, phase), 0))
        yield family


ADAPTERS = AdapterPhases()
REGISTRY.register(ADAPTERS)


@contextmanager
def reconcile(kind: str) -> Iterator[None]:
    """Count and time one reconcile; an exception counts as an error and goes on."""
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        RECONCILES.labels(kind, "error").inc()
        raise
    else:
        RECONCILES.labels(kind, "ok").inc()
    finally:
        RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - start)


def outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


class CountingTransport(httpx.AsyncBaseTransport):
    """The admin client's transport, counting every call by pod and outcome (a connection failure or timeout is
    `unreachable`)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pod = f"{request.url.host}:{request.url.port}"
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.TransportError:
            ADMIN_CALLS.labels(pod, "unreachable").inc()
            raise
        ADMIN_CALLS.labels(pod, outcome(response.status_code)).inc()
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def serve(port: int, address: str = "0.0.0.0") -> None:
    """GET /metrics (and any path) on `port`, from a daemon thread."""
    start_http_server(port, addr=address, registry=REGISTRY)
