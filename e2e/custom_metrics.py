"""A small custom-metrics API server (custom.metrics.k8s.io/v1beta2) that stands in for Prometheus and
prometheus-adapter: it serves a per-pod metric (loraplane_queue_depth) read from each pod's /metrics at the
moment the HPA asks. The kube-aggregator reaches it through an APIService and an ExternalName Service.

    python -m e2e.custom_metrics --kubeconfig K --port P --cert C --key K --client-ca FRONT_PROXY_CA

HTTPS only; clients must present a certificate from the front-proxy CA whose CN is an allowed name (the
aggregator's proxy client), as extension API servers behind the aggregator require. One line per metrics
request goes to stderr: the user the aggregator vouches for (X-Remote-User), the path and the values.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import re
import ssl
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from prometheus_client.parser import text_string_to_metric_families

from e2e.api import ApiClient, ApiError, http_get

GROUP = "custom.metrics.k8s.io"
VERSION = "v1beta2"
GROUP_VERSION = f"{GROUP}/{VERSION}"
METRIC = "loraplane_queue_depth"
SCRAPE_TIMEOUT_S = 2.0
_POD_METRIC_PATH = re.compile(rf"^/apis/{re.escape(GROUP_VERSION)}/namespaces/([^/]+)/pods/([^/]+)/([^/]+)$")


# reading the pods


def parse_metric(text: str, metric: str) -> float | None:
    """The value of an unlabelled gauge in Prometheus' text format; None when the text lacks it."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and not sample.labels:
                return float(sample.value)
    return None


def pod_metrics_port(pod: dict[str, Any], port_name: str) -> int:
    """The container port named `port_name` (the server's `http`), else the first one, else 8080."""
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or []]
    named = [p["containerPort"] for p in ports if p.get("name") == port_name]
    return int((named or [p["containerPort"] for p in ports] or [8080])[0])


class PodMetrics:
    """Lists pods through the API server and scrapes the running ones."""

    def __init__(self, api: ApiClient, metric: str = METRIC, port_name: str = "http") -> None:
        self.api = api
        self.metric = metric
        self.port_name = port_name

    def read(self, namespace: str, name: str, label_selector: str) -> list[tuple[dict[str, Any], float]]:
        """(pod, value) for the pod `name`, or for every pod matching `label_selector` when name is `*`."""
        path = f"/api/v1/namespaces/{namespace}/pods"
        if name == "*":
            params = {"labelSelector": label_selector} if label_selector else {}
            pods = self.api.get(path, **params)["items"]
        else:
            try:
                pods = [self.api.get(f"{path}/{name}")]
            except ApiError as error:
                if error.status == 404:
                    return []
                raise
        out: list[tuple[dict[str, Any], float]] = []
        for pod in pods:
            value = self._scrape(pod)
            if value is not None:
                out.append((pod, value))
        return out

    def _scrape(self, pod: dict[str, Any]) -> float | None:
        ip = pod.get("status", {}).get("podIP")
        if pod.get("status", {}).get("phase") != "Running" or not ip or pod["metadata"].get("deletionTimestamp"):
            return None
        url = f"http://{ip}:{pod_metrics_port(pod, self.port_name)}/metrics"
        try:
            response = http_get(url, SCRAPE_TIMEOUT_S)
        except OSError as error:  # requests' errors are OSErrors: a pod still starting, or stopping
            print(f"scrape {url}: {error}", flush=True)
            return None
        if not response.ok:
            print(f"scrape {url}: HTTP {response.status_code}", flush=True)
            return None
        return parse_metric(response.text, self.metric)


# the API objects


def api_resource_list(metric: str) -> dict[str, Any]:
    resource = {"name": f"pods/{metric}", "singularName": "", "namespaced": True, "kind": "MetricValueList"}
    resource["verbs"] = ["get"]
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION, "resources": [resource]}


def api_group() -> dict[str, Any]:
    version = {"groupVersion": GROUP_VERSION, "version": VERSION}
    return {"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": [version], "preferredVersion": version}


def metric_value_list(
    metric: str, values: list[tuple[dict[str, Any], float]], now: datetime.datetime
) -> dict[str, Any]:
    timestamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    items = []
    for pod, value in values:
        meta = pod["metadata"]
        described = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"]}
        items.append(
            {
                "describedObject": described,
                "metric": {"name": metric},
                "timestamp": timestamp,
                "windowSeconds": 1,
                "value": f"{round(value * 1000)}m",  # a Quantity in milli-units: 2.5 -> 2500m
            }
        )
    return {"kind": "MetricValueList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": items}


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def registration_manifests(namespace: str, service: str, port: int, ca_file: Path) -> list[dict[str, Any]]:
    """The Namespace, an ExternalName Service pointing at this machine, and the APIService (TLS verified
    against `ca_file` for the name `<service>.<namespace>.svc`, which the serving cert must carry)."""
    svc_spec = {"type": "ExternalName", "externalName": "localhost"}
    ca_bundle = base64.b64encode(ca_file.read_bytes()).decode()
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": service, "namespace": namespace},
            "spec": svc_spec,
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": f"{VERSION}.{GROUP}"},
            "spec": {
                "group": GROUP,
                "version": VERSION,
                "service": {"namespace": namespace, "name": service, "port": port},
                "caBundle": ca_bundle,
                "groupPriorityMinimum": 100,
                "versionPriority": 200,
            },
        },
    ]


# the HTTPS server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 - the http.server naming
        if not self.server.is_allowed_client(self.connection):
            self._send(403, status_object(403, "Forbidden", "a client certificate from the front-proxy CA is required"))
            return
        url = urlparse(self.path)
        match = _POD_METRIC_PATH.match(unquote(url.path))  # client-go sends the `*` of "all pods" as %2A
        if url.path in ("/healthz", "/readyz", "/livez"):
            self._send_text(200, "ok")
        elif url.path == f"/apis/{GROUP}":
            self._send(200, api_group())
        elif url.path == f"/apis/{GROUP_VERSION}":
            self._send(200, api_resource_list(self.server.source.metric))
        elif match:
            namespace, name, metric = match.groups()
            self._metric(namespace, name, metric, parse_qs(url.query).get("labelSelector", [""])[0])
        else:
            self._send(404, status_object(404, "NotFound", f"{url.path} is not served here"))

    def _metric(self, namespace: str, name: str, metric: str, selector: str) -> None:
        if metric != self.server.source.metric:
            self._send(404, status_object(404, "NotFound", f"the metric {metric} is not served for pods"))
            return
        values = self.server.source.read(namespace, name, selector)
        user = self.headers.get("X-Remote-User", "")
        shown = {pod["metadata"]["name"]: value for pod, value in values}
        line = f"metrics request user={user} namespace={namespace} pods={name} selector={selector}"
        print(f"{line} values={json.dumps(shown)}")  # one write per line: handler threads run concurrently
        self._send(200, metric_value_list(metric, values, datetime.datetime.now(datetime.timezone.utc)))

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass  # one line per metrics request is printed by _metric; discovery polls would drown it


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], source: PodMetrics, context: ssl.SSLContext, allowed_names: list[str]
    ) -> None:
        super().__init__(address, Handler)
        self.source = source
        self.allowed_names = allowed_names
        # the handshake happens in the request's thread, not in the accept loop
        self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def finish_request(self, request: Any, client_address: Any) -> None:
        try:
            request.do_handshake()
        except (ssl.SSLError, OSError):
            return
        super().finish_request(request, client_address)

    def is_allowed_client(self, connection: Any) -> bool:
        cert: dict[str, Any] = (connection.getpeercert() if isinstance(connection, ssl.SSLSocket) else None) or {}
        names = [attr[1] for rdn in cert.get("subject", ()) for attr in rdn if attr[0] == "commonName"]
        return bool(names) and names[0] in self.allowed_names


def tls_context(cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    context.load_verify_locations(str(client_ca))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True, help="to list pods")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--client-ca", type=Path, required=True, help="the front-proxy CA")
    parser.add_argument("--allowed-name", action="append", default=[], help="allowed client cert CNs")
    parser.add_argument("--metric", default=METRIC)
    args = parser.parse_args(argv)
    source = PodMetrics(ApiClient.from_kubeconfig(args.kubeconfig), args.metric)
    context = tls_context(args.cert, args.key, args.client_ca)
    server = MetricsServer((args.host, args.port), source, context, args.allowed_name or ["front-proxy-client"])
    print(f"serving {GROUP_VERSION} ({args.metric}) on https://{args.host}:{args.port}", flush=True)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    server.serve_forever()


if __name__ == "__main__":
    main()
