"""The monitoring stack a user installs beside the chart, run for real on the local control plane: Prometheus
(scraping the pods through Kubernetes service discovery, as the chart's PodMonitors describe them; the chart's
PrometheusRule loaded as its rule file) and KEDA (its operator and its metrics API server, registered as the
APIService v1beta1.external.metrics.k8s.io), built by e2e/build_monitoring.sh.

They run as local processes, like the control plane, under their own RBAC where a cluster gives them one:
Prometheus with a ServiceAccount bound to the ClusterRole its own Helm chart grants (get/list/watch pods,
services, endpoints, nodes); KEDA with the admin kubeconfig (its chart's RBAC is a wide ClusterRole anyway).

prometheus-operator's CRDs are applied (its module's, through the Go module proxy), so the chart's PodMonitors and
PrometheusRule are created and validated as in a user's cluster, but the operator itself is not run:
`podmonitor_scrape_configs` turns each PodMonitor into the scrape job that
prometheus-operator generates for it (pod role, the selector's labels kept, the named port kept, the
namespace, pod and container labels), so a PodMonitor that selects nothing or names a wrong port shows as
no series.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from e2e.cluster import LocalCluster, free_port
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.pki import Pki
from e2e.process import spawn, stop

BUILD_SCRIPT = Path(__file__).with_name("build_monitoring.sh")
PROMETHEUS_VERSION = "v0.316.0"  # the Go module's version: Prometheus 3.16.0
KEDA_VERSION = "v2.21.0"
# prometheus-operator's CRDs (PodMonitor, ServiceMonitor, PrometheusRule), applied so that the chart's objects are
# created as in a user's cluster and validated against the real schemas; the operator itself is not run
PROMETHEUS_OPERATOR = ("github.com/prometheus-operator/prometheus-operator", "v0.85.0")
PROMETHEUS_OPERATOR_CRDS = ("podmonitors", "servicemonitors", "prometheusrules")
KEDA_NAMESPACE = "keda"
KEDA_METRICS_SERVICE = "keda-metrics-apiserver"
EXTERNAL_METRICS = ("external.metrics.k8s.io", "v1beta1")
PROMETHEUS_ACCOUNT = ("monitoring", "prometheus")


@dataclass(frozen=True)
class Binaries:
    prometheus: Path
    keda: Path
    keda_adapter: Path
    keda_crds: Path


def cache_dir() -> Path:
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def built() -> Binaries | None:
    """The binaries, when e2e/build_monitoring.sh has built both components; None otherwise."""
    root = cache_dir()
    prom, keda = root / f"prometheus-{PROMETHEUS_VERSION}", root / f"keda-{KEDA_VERSION}"
    found = Binaries(prom / "prometheus", keda / "keda", keda / "keda-adapter", keda / "crds")
    complete = (prom / ".complete").exists() and (keda / ".complete").exists()
    return found if complete and found.prometheus.exists() and found.keda_adapter.exists() else None


def build() -> Binaries:
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    found = built()
    assert found is not None, "e2e/build_monitoring.sh finished without its binaries"
    return found


def apply_prometheus_operator_crds(kubectl: Kubectl) -> None:
    """PodMonitor, ServiceMonitor and PrometheusRule from prometheus-operator's module (the Go module cache;
    downloaded once), Established."""
    module, version = PROMETHEUS_OPERATOR
    argv = ["go", "mod", "download", "-json", f"{module}@{version}"]
    result = subprocess.run(argv, env={**os.environ, "GOFLAGS": ""}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(argv)}: {result.stdout[-500:]} {result.stderr[-500:]}"
    directory = Path(json.loads(result.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    for plural in PROMETHEUS_OPERATOR_CRDS:
        kubectl("apply", "--server-side", "-f", str(directory / f"monitoring.coreos.com_{plural}.yaml"))
    for plural in PROMETHEUS_OPERATOR_CRDS:
        kubectl("wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com", "--timeout=60s")


# Prometheus


def _label(name: str) -> str:
    """A Kubernetes label name as Prometheus' service discovery spells it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def podmonitor_scrape_configs(podmonitors: list[dict[str, Any]], kubeconfig: Path) -> list[dict[str, Any]]:
    """The scrape jobs prometheus-operator generates for these PodMonitors (the fields the chart uses:
    selector.matchLabels / matchExpressions Exists, namespaceSelector.matchNames, podMetricsEndpoints' port,
    path and interval)."""
    jobs = []
    for monitor in podmonitors:
        assert monitor["kind"] == "PodMonitor", monitor["kind"]
        meta, spec = monitor["metadata"], monitor["spec"]
        namespaces = spec.get("namespaceSelector", {}).get("matchNames") or [meta["namespace"]]
        keep: list[dict[str, Any]] = [
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
        ]
        for key, value in (spec["selector"].get("matchLabels") or {}).items():
            labels = [f"__meta_kubernetes_pod_label_{_label(key)}", f"__meta_kubernetes_pod_labelpresent_{_label(key)}"]
            keep.append({"action": "keep", "source_labels": labels, "regex": f"({re.escape(value)});true"})
        for expression in spec["selector"].get("matchExpressions") or []:
            assert expression["operator"] == "Exists", expression  # the only operator the chart uses
            present = f"__meta_kubernetes_pod_labelpresent_{_label(expression['key'])}"
            keep.append({"action": "keep", "source_labels": [present], "regex": "true"})
        for i, endpoint in enumerate(spec["podMetricsEndpoints"]):
            port = {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"]}
            relabel = [
                *keep,
                {**port, "regex": endpoint["port"]},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            ]  # fmt: skip
            job = {
                "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
                "kubernetes_sd_configs": [
                    {"role": "pod", "kubeconfig_file": str(kubeconfig), "namespaces": {"names": namespaces}}
                ],
                "metrics_path": endpoint.get("path", "/metrics"),
                "relabel_configs": relabel,
            }
            if endpoint.get("interval"):
                job["scrape_interval"] = endpoint["interval"]
            jobs.append(job)
    return jobs


def prometheus_kubeconfig(cluster: LocalCluster, kubectl: Kubectl) -> Path:
    """A ServiceAccount with the ClusterRole Prometheus' own chart grants its server (read pods, services,
    endpoints and nodes), and a kubeconfig with its token."""
    namespace, name = PROMETHEUS_ACCOUNT
    rules = [
        {"apiGroups": [""], "resources": ["nodes", "services", "endpoints", "pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]},
    ]
    subject = {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "e2e-prometheus"}
    for manifest in (
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "e2e-prometheus"},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "e2e-prometheus"}, "roleRef": role_ref, "subjects": [subject]},
    ):  # fmt: skip
        kubectl.apply(manifest)
    return cluster.service_account_kubeconfig(namespace, name)


class Prometheus:
    """A Prometheus server on loopback: its configuration rewritten and reloaded (/-/reload) as the tests add
    jobs; queries through its HTTP API."""

    def __init__(self, binary: Path, directory: Path, kubeconfig: Path, evaluation_interval: str = "2s") -> None:
        self.binary, self.directory = binary, directory
        self.kubeconfig = kubeconfig  # what its Kubernetes service discovery lists and watches with
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_file = directory / "prometheus.yml"
        self.rules_file = directory / "rules.yml"
        self.log = directory / "prometheus.log"
        self.global_config = {"scrape_interval": "2s", "evaluation_interval": evaluation_interval}
        self.jobs: list[dict[str, Any]] = []
        self.rule_groups: list[dict[str, Any]] = []
        self.process: subprocess.Popen[bytes] | None = None
        self.session = requests.Session()
        self.session.trust_env = False

    def _write(self) -> None:
        self.rules_file.write_text(yaml.safe_dump({"groups": self.rule_groups}))
        config = {"global": self.global_config, "rule_files": [str(self.rules_file)], "scrape_configs": self.jobs}
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write()
        argv = [str(self.binary), f"--config.file={self.config_file}", f"--storage.tsdb.path={self.directory / 'data'}"]
        argv += [f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle", "--log.level=info"]
        self.process = spawn(argv, self.log, cwd=self.directory)
        wait_until(self._ready, timeout=60, what="Prometheus ready", interval=0.5)

    def _ready(self) -> bool:
        assert self.process is not None and self.process.poll() is None, self.log.read_text()[-3000:]
        try:
            return self.session.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def configure(
        self, jobs: list[dict[str, Any]] | None = None, rule_groups: list[dict[str, Any]] | None = None
    ) -> None:
        """Replace the scrape jobs and/or rule groups, and reload (a configuration Prometheus refuses fails here)."""
        if jobs is not None:
            self.jobs = jobs
        if rule_groups is not None:
            self.rule_groups = rule_groups
        self._write()
        response = self.session.post(f"{self.url}/-/reload", timeout=30)
        assert response.status_code == 200, f"Prometheus refused its configuration: {response.text}"

    def api(self, path: str, **params: str) -> Any:
        response = self.session.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector's samples); a query Prometheus cannot parse fails here."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def value(self, expr: str) -> float | None:
        """A single-sample query's value; None when it returns no series."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def firing(self) -> set[str]:
        """The names of the alerts firing now."""
        return {a["labels"]["alertname"] for a in self.api("alerts")["alerts"] if a["state"] == "firing"}

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
        self.session.close()


# KEDA


def apply_keda_crds(kubectl: Kubectl, crds: Path) -> None:
    for path in sorted(crds.glob("*.yaml")):
        kubectl("apply", "--server-side", "-f", str(path))
    for path in sorted(crds.glob("*.yaml")):
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


def external_metrics_manifests(port: int, ca_file: Path) -> list[dict[str, Any]]:
    """What KEDA's chart registers, pointed at this machine: the keda Namespace, an ExternalName Service (the
    aggregator resolves it by name, so loopback works; see e2e/README.md), the APIService with the cluster CA,
    and the binding that lets the HPA controller read external metrics."""
    group, version = EXTERNAL_METRICS
    reader = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "keda-external-metrics-reader"},
        "rules": [{"apiGroups": [group], "resources": ["*"], "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "keda-hpa-controller-external-metrics"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader["metadata"]["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler", "namespace": "kube-system"}],
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KEDA_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": KEDA_METRICS_SERVICE, "namespace": KEDA_NAMESPACE},
            "spec": {"type": "ExternalName", "externalName": "localhost"},
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": f"{version}.{group}"},
            "spec": {
                "group": group,
                "version": version,
                "service": {"namespace": KEDA_NAMESPACE, "name": KEDA_METRICS_SERVICE, "port": port},
                "caBundle": base64.b64encode(ca_file.read_bytes()).decode(),
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
        reader,
        binding,
    ]


class Keda:
    """KEDA's operator (ScaledObjects -> HPAs, activation 0 <-> 1, the triggers polled) and its metrics API
    server (external.metrics.k8s.io for the HPA controller, asking the operator over mutual-TLS gRPC)."""

    def __init__(self, binaries: Binaries, cluster: LocalCluster, directory: Path) -> None:
        self.binaries, self.cluster, self.directory = binaries, cluster, directory
        self.operator_log = directory / "keda-operator.log"
        self.adapter_log = directory / "keda-metrics-apiserver.log"
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, kubectl: Kubectl) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        apply_keda_crds(kubectl, self.binaries.keda_crds)
        # the operator <-> metrics server link: one CA, one cert both ends present (as KEDA's cert rotation makes)
        grpc_dir = self.directory / "grpc-certs"
        pki = Pki(grpc_dir, ca_name="keda-e2e-grpc-ca")
        pki.peer_cert("tls", ["localhost", f"keda-operator.{KEDA_NAMESPACE}.svc"], ["127.0.0.1"])
        grpc_port, adapter_port = free_port(), free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "WATCH_NAMESPACE": "",
            "POD_NAMESPACE": KEDA_NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
        }
        operator = [str(self.binaries.keda), "--zap-log-level=info", "--zap-encoder=console"]
        operator += [
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address=127.0.0.1:{free_port()}",
        ]
        operator += [f"--metrics-service-bind-address=127.0.0.1:{grpc_port}", f"--cert-dir={grpc_dir}"]
        self.processes.append(spawn(operator, self.operator_log, cwd=self.directory, env=env))
        # the metrics server: served to the aggregator with a cluster-CA cert (the APIService's caBundle)
        dns = [f"{KEDA_METRICS_SERVICE}.{KEDA_NAMESPACE}.svc", "localhost"]
        cert, key = self.cluster.pki.serving_cert("keda-metrics-apiserver", dns, ["127.0.0.1"])
        kubeconfig = str(self.cluster.kubeconfig)
        adapter = [str(self.binaries.keda_adapter), "--zap-log-level=info", "--zap-encoder=console"]
        adapter += [f"--secure-port={adapter_port}", "--bind-address=127.0.0.1", f"--cert-dir={grpc_dir}"]
        adapter += [f"--tls-cert-file={cert}", f"--tls-private-key-file={key}", f"--port={free_port()}"]
        adapter += [f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}"]
        adapter += [f"--authorization-kubeconfig={kubeconfig}", f"--metrics-service-address=127.0.0.1:{grpc_port}"]
        adapter += ["--metrics-service-grpc-authority=localhost"]
        self.processes.append(spawn(adapter, self.adapter_log, cwd=self.directory, env=env))
        for manifest in external_metrics_manifests(adapter_port, self.cluster.pki.ca_file):
            kubectl.apply(manifest)
        group, version = EXTERNAL_METRICS
        self._wait_available(kubectl, f"{version}.{group}")

    def _wait_available(self, kubectl: Kubectl, apiservice: str) -> None:
        def available() -> bool:
            for process, log in zip(self.processes, (self.operator_log, self.adapter_log), strict=True):
                assert process.poll() is None, f"{log.name} exited:\n{log.read_text()[-4000:]}"
            status = kubectl.json("get", "apiservice", apiservice).get("status") or {}
            return any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions") or [])

        wait_until(available, timeout=120, what=f"the APIService {apiservice} Available", interval=1)

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for log in (self.operator_log, self.adapter_log):
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            out.append(f"--- {log.name} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def stop(self, kubectl: Kubectl) -> None:
        group, version = EXTERNAL_METRICS
        try:
            kubectl("delete", "apiservice", f"{version}.{group}", "--wait=false")
        except KubectlError:
            pass
        for process in self.processes:
            stop(process)


@contextmanager
def keda_running(binaries: Binaries, cluster: LocalCluster, kubectl: Kubectl, directory: Path) -> Iterator[Keda]:
    keda = Keda(binaries, cluster, directory)
    try:
        keda.start(kubectl)
        yield keda
    finally:
        keda.stop(kubectl)


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of a Grafana dashboard's panels (rows' panels too)."""
    out = []
    stack = list(dashboard.get("panels") or [])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels") or [])
        for target in panel.get("targets") or []:
            if target.get("expr"):
                out.append((str(panel.get("title")), str(target["expr"])))
    return out


def wait_value(prometheus: Prometheus, expr: str, check: Any, timeout: float, what: str) -> float:
    """Until the query's single value passes `check`; that value."""

    def passes() -> tuple[float] | None:
        value = prometheus.value(expr)
        return (value,) if value is not None and check(value) else None  # a tuple: 0.0 is an answer too

    return wait_until(passes, timeout=timeout, what=what, interval=1)[0]
