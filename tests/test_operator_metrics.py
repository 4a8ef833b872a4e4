"""The operator's /metrics: the admin client's calls counted per pod and outcome against real HTTP servers,
reconciles counted and timed, adapters per phase, all served by prometheus-client on a real port."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane_operator import metrics
from loraplane_operator.admin_client import make_http_client


class Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status = int(self.path.strip("/") or 200)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sample(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_admin_calls_are_counted_per_pod_and_outcome(server):
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: unreachable
    before = {o: sample("loraplane_operator_admin_calls_total", pod=server, outcome=o) for o in metrics_outcomes()}

    async def calls() -> None:
        async with make_http_client(timeout_s=5) as http:
            for status in (200, 200, 404, 503):
                await http.get(f"http://{server}/{status}")
            with pytest.raises(httpx.ConnectError):
                await http.get(f"http://{closed}/")

    asyncio.run(calls())
    after = {o: sample("loraplane_operator_admin_calls_total", pod=server, outcome=o) for o in metrics_outcomes()}
    assert {o: after[o] - before[o] for o in after} == {"ok": 2, "client_error": 1, "server_error": 1, "unreachable": 0}
    assert sample("loraplane_operator_admin_calls_total", pod=closed, outcome="unreachable") == 1


def metrics_outcomes() -> tuple[str, ...]:
    return ("ok", "client_error", "server_error", "unreachable")


def test_reconciles_are_counted_and_timed():
    kind = "LoRAAdapter"
    ok, err = (sample("loraplane_operator_reconciles_total", kind=kind, result=r) for r in ("ok", "error"))
    timed = sample("loraplane_operator_reconcile_duration_seconds_count", kind=kind)
    with metrics.reconcile(kind):
        pass
    with pytest.raises(RuntimeError), metrics.reconcile(kind):
        raise RuntimeError("refused")
    assert sample("loraplane_operator_reconciles_total", kind=kind, result="ok") == ok + 1
    assert sample("loraplane_operator_reconciles_total", kind=kind, result="error") == err + 1
    assert sample("loraplane_operator_reconcile_duration_seconds_count", kind=kind) == timed + 2


def test_adapters_per_phase_and_the_served_page():
    phases = metrics.AdapterPhases()
    phases.set("ml", "a", "Ready")
    phases.set("ml", "b", "Ready")
    phases.set("ml", "c", "Failed")
    phases.set("ml", "c", "Loading")  # a phase moves: counted once, where it is now
    phases.set("other", "d", "Pending")
    phases.set("ml", "b", None)  # deleted
    (family,) = list(phases.collect())
    got = {(s.labels["namespace"], s.labels["phase"]): s.value for s in family.samples if s.value}
    assert got == {("ml", "Ready"): 1, ("ml", "Loading"): 1, ("other", "Pending"): 1}
    assert len(family.samples) == 2 * len(metrics.PHASES)  # every phase per namespace, zeros included

    metrics.ADAPTERS.set("served", "x", "Degraded")
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in (
        "loraplane_operator_reconciles",
        "loraplane_operator_reconcile_duration_seconds",
        "loraplane_operator_admin_calls",
        "loraplane_operator_retries",
        "loraplane_operator_adapters",
    ):
        assert name in names, sorted(names)
    assert 'loraplane_operator_adapters{namespace="served",phase="Degraded"} 1.0' in text
    metrics.ADAPTERS.set("served", "x", None)
