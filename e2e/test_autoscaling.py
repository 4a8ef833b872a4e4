"""Autoscaling and monitoring through the real stack (e2e/monitoring.py, built by e2e/build_monitoring.sh):
Prometheus scrapes the server, router and operator pods through Kubernetes service discovery as the chart's
PodMonitors describe them; the operator's KEDA ScaledObject (Prometheus triggers) makes KEDA's HPA, which the
kube-controller-manager's HPA controller drives through KEDA's metrics API server (external.metrics.k8s.io, via
the aggregator). Scenarios: queued load scales a BaseModelServer from 1 to 3 pods and back after the cool-down;
the pool at zero wakes on a request the router holds and serves it; every dashboard query and alert expression
of the chart parses and returns series in that Prometheus, and the rules evaluate."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from e2e import monitoring
from e2e.cluster import REPO_ROOT, LocalCluster
from e2e.helm import Helm, HelmError
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.monitoring import Binaries, Keda, Prometheus
from e2e.operator_fixtures import (
    SERVER_LABEL,
    adapter_manifest,
    diagnostics,
    is_ready,
    local_server_sample,
    pod_url,
    ready_server_pods,
    server_pods,
    snapshot_adapters,
)

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-autoscaling"
SERVER = "scaler"
ROUTER = f"{SERVER}-router"
TARGET_QUEUE_DEPTH = 2
MAX_REPLICAS = 3
STABILIZATION_S = 10  # the HPA's scale-down window, and KEDA's cooldown to zero
POLLING_S = 2  # KEDA's Prometheus polling
MAX_NUM_SEQS = 2  # one pod runs two requests; the other clients wait in its queue
NUM_CLIENTS = 8  # so the queue holds about 6: ceil(6 / TARGET_QUEUE_DEPTH) = 3 pods wanted
MAX_TOKENS = 300
POD_START_S = 300.0
SCRAPE = "2s"
METRIC_SOURCES = (
    "server/loraplane_server/serving/http/metrics.py",
    "server/loraplane_server/serving/router/metrics.py",
    "operator/loraplane_operator/metrics.py",
    "operator/loraplane_operator/constants.py",
)


# the stack


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    found = monitoring.built()
    if found is not None:
        return found
    if shutil.which("go") is None:
        pytest.skip("Go is not available to build Prometheus and KEDA")
    if os.environ.get("LORAPLANE_E2E_BUILD") != "1":
        pytest.skip("Prometheus and KEDA are not built: run e2e/build_monitoring.sh or set LORAPLANE_E2E_BUILD=1")
    return monitoring.build()


@pytest.fixture(scope="module")
def prometheus(
    binaries: Binaries, cluster: LocalCluster, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    kubeconfig = monitoring.prometheus_kubeconfig(cluster, kubectl)
    server = Prometheus(binaries.prometheus, Path(tmp_path_factory.mktemp("prometheus")), kubeconfig)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keda(
    binaries: Binaries, cluster: LocalCluster, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Keda]:
    with monitoring.keda_running(binaries, cluster, kubectl, Path(tmp_path_factory.mktemp("keda"))) as running:
        yield running


CHART = REPO_ROOT / "helm" / "loraplane"
RELEASE = "lp"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-loraplane"  # the chart's operator (the RBAC audit)
UNINSTALLS: list[datetime] = []  # when this module's `helm uninstall` began (its operator's 403s after are not RBAC's)
CHART_VALUES: dict[str, Any] = {
    # the chart's operator as a pod on the process kubelet, watching this namespace; liveness and metrics bound to
    # its own pod address (the pods share this machine's network)
    "operator": {
        "watchNamespace": NAMESPACE,
        "livenessBindAddress": "$(POD_IP)",
        "replicas": 1,
        "leaderElection": {"enabled": False},
    },
    "monitoring": {
        "podMonitor": {"enabled": True, "interval": SCRAPE},
        "dashboard": {"enabled": True},
        "alerts": {"enabled": True, "adapterFailedFor": "0s"},
    },
}


@pytest.fixture(scope="module")
def chart_values_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("chart")) / "values.yaml"
    path.write_text(yaml.safe_dump(CHART_VALUES))
    return path


@pytest.fixture(scope="module")
def chart(helm: Helm, chart_values_file: Path) -> list[dict[str, Any]]:
    """The chart rendered with monitoring on (scrapes every 2 s) into the test's namespace."""
    rendered = helm("template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(chart_values_file))
    return [d for d in yaml.safe_load_all(rendered) if isinstance(d, dict)]


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    helm: Helm
    prometheus: Prometheus
    keda: Keda
    chart: list[dict[str, Any]]

    def get(self, *args: str) -> Any:
        return self.kubectl.json("get", *args, "-n", NAMESPACE)


@pytest.fixture(scope="module")
def env(
    kubectl: Kubectl,
    cluster: LocalCluster,
    helm: Helm,
    prometheus: Prometheus,
    keda: Keda,
    chart: list[dict[str, Any]],
    chart_values_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    work = Path(tmp_path_factory.mktemp("autoscaling"))
    # what Prometheus scrapes: the chart's PodMonitors (servers, routers, the operator's pod), as prometheus-operator
    # turns them into scrape jobs; the chart's rules
    monitors = [d for d in chart if d["kind"] == "PodMonitor"]
    (rule,) = [d for d in chart if d["kind"] == "PrometheusRule"]
    prometheus.configure(
        jobs=monitoring.podmonitor_scrape_configs(monitors, prometheus.kubeconfig), rule_groups=rule["spec"]["groups"]
    )
    environment = Env(kubectl, cluster, helm, prometheus, keda, chart)
    monitoring.apply_prometheus_operator_crds(kubectl)  # as kube-prometheus-stack would have
    try:
        helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "-f", str(chart_values_file))
        kubectl("rollout", "status", f"deployment/{RELEASE}-loraplane-operator", "-n", NAMESPACE, "--timeout=120s")
        adapters = snapshot_adapters(work / "adapters")
        kubectl.apply(server_manifest(adapters, prometheus.url), NAMESPACE)
        # two adapters prewarmed into the server (loads, hits, residency for the dashboard), and one whose source
        # the server's allowlist refuses: Failed, which the chart's LoraplaneAdapterFailed alert reports
        kubectl.apply(adapter_manifest("french", SERVER, str(adapters / "french")), NAMESPACE)
        kubectl.apply(adapter_manifest("pirate", SERVER, str(adapters / "pirate"), tier="device"), NAMESPACE)
        kubectl.apply(adapter_manifest("refused", SERVER, "/not/allowed/adapter"), NAMESPACE)
        yield environment
    finally:
        for kind in ("lora", "bms"):  # while the operator runs: it unloads them and drops its finalizers
            try:
                kubectl("delete", kind, "--all", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
            except KubectlError:
                pass
        UNINSTALLS.append(datetime.now(UTC))
        try:
            helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "2m")
        except HelmError:
            pass
        try:
            kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        except KubectlError:
            pass


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, kubectl: Kubectl, cluster: LocalCluster) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        env: Env | None = request.node.funcargs.get("env")
        text = diagnostics(kubectl, cluster, None, NAMESPACE)
        for args in (("hpa",), ("scaledobject",)):
            text += f"\n--- {args[0]} ---\n{_safe(kubectl, 'get', *args, '-n', NAMESPACE, '-o', 'yaml')}"
        text += f"\n--- kube-controller-manager ---\n{cluster.log_tail('kube-controller-manager', 30)}"
        if env is not None:
            text += "\n" + env.keda.log_tail()
            text += f"\n--- prometheus ---\n{_tail(env.prometheus.log, 30)}"
        print(f"\n===== diagnostics after {request.node.name} =====\n{text}")


def _safe(kubectl: Kubectl, *args: str) -> str:
    try:
        return kubectl(*args)
    except KubectlError as error:
        return str(error)


def _tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def server_manifest(adapters_dir: Path, prometheus_url: str) -> dict[str, Any]:
    """A one-pod server on the process kubelet (one torch thread per pod: the machine may have two cores),
    KEDA-autoscaled between 1 and MAX_REPLICAS on queue depth, with a router in front (what a pool at zero
    needs)."""
    bms = local_server_sample(adapters_dir, replicas=1)
    bms["metadata"]["name"] = SERVER
    bms["spec"]["engine"].update(maxNumSeqs=MAX_NUM_SEQS, kvCacheGiB=0.1)
    bms["spec"]["args"] += ["--torch-threads", "1"]
    bms["spec"]["autoscaling"] = {
        "enabled": True,
        "kind": "keda",
        "minReplicas": 1,
        "maxReplicas": MAX_REPLICAS,
        "targetQueueDepth": TARGET_QUEUE_DEPTH,
        "scaleDownStabilizationSeconds": STABILIZATION_S,
        "pollingIntervalSeconds": POLLING_S,
        "prometheusAddress": prometheus_url,
    }
    bms["spec"]["router"] = {
        "enabled": True,
        "replicas": 1,
        "command": [sys.executable, "-m", "loraplane_server.serving.cli", "router"],
        "holdTimeoutSeconds": int(POD_START_S),
    }
    return bms


# load


class QueuedLoad:
    """NUM_CLIENTS threads, each streaming one long completion after another from one pod until stopped;
    closing a stream aborts its request on the server, so stop() empties the queue."""

    def __init__(self, url: str, num_clients: int) -> None:
        self.url = url
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.num_tokens = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(num_clients)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def _client(self) -> None:
        body: dict[str, Any] = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS}
        body.update(temperature=0, ignore_eos=True, stream=True)
        with requests.Session() as session:
            session.trust_env = False
            while not self.stopping.is_set():
                try:
                    with session.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=300) as response:
                        if response.status_code != 200:
                            self._error(f"{response.status_code} {response.text[:200]}")
                            time.sleep(1)
                            continue
                        for line in response.iter_lines():
                            if self.stopping.is_set():
                                break
                            if line.startswith(b"data: {"):
                                with self._lock:
                                    self.num_tokens += 1
                except requests.RequestException as error:
                    self._error(str(error))
                    time.sleep(1)

    def _error(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)


# waits


def wait_replicas(env: Env, replicas: int, timeout: float) -> list[dict[str, Any]]:
    """The Deployment at `replicas` and exactly that many server pods Ready (none left terminating)."""

    def settled() -> list[dict[str, Any]] | None:
        spec_replicas = env.get("deployment", SERVER)["spec"]["replicas"]
        pods = server_pods(env.kubectl, NAMESPACE, SERVER)
        ready = ready_server_pods(env.kubectl, NAMESPACE, SERVER)
        all_pods = env.get("pods", "-l", f"{SERVER_LABEL}={SERVER}")["items"]
        if spec_replicas == replicas and len(ready) == len(pods) == len(all_pods) == replicas:
            return ready or [{}]
        return None

    return [p for p in wait_until(settled, timeout=timeout, what=f"{replicas} server pods Ready", interval=1) if p]


def wait_deployment_replicas(env: Env, replicas: int, timeout: float) -> float:
    """Until the Deployment's spec.replicas (what the HPA or KEDA sets) is `replicas`; the monotonic time then."""

    def scaled() -> float | None:
        return time.monotonic() if env.get("deployment", SERVER)["spec"]["replicas"] == replicas else None

    return wait_until(scaled, timeout=timeout, what=f"the Deployment scaled to {replicas}", interval=1)


def router_pod(env: Env) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pods = env.get("pods", "-l", f"app.kubernetes.io/component=router,loraplane.dev/router={SERVER}")["items"]
        return next((p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")), None)

    return wait_until(ready, timeout=POD_START_S, what="the router pod Ready", interval=1)


def queue_query(pod: str = "") -> str:
    return f'sum(loraplane_queue_depth{{namespace="{NAMESPACE}",pod=~"{pod or SERVER + "-.*"}"}})'


# the tests


def test_a_prometheus_scrapes_the_pods_the_chart_monitors(env: Env) -> None:
    (first,) = wait_replicas(env, 1, POD_START_S)
    router = router_pod(env)

    def targets_up() -> dict[str, set[str]] | None:
        up: dict[str, set[str]] = {}
        for target in env.prometheus.active_targets():
            if target["health"] == "up":
                up.setdefault(target["labels"]["job"], set()).add(target["labels"].get("pod", ""))
        servers = up.get(f"podMonitor/{NAMESPACE}/lp-loraplane-servers/0", set())
        routers = up.get(f"podMonitor/{NAMESPACE}/lp-loraplane-routers/0", set())
        operators = up.get(f"podMonitor/{NAMESPACE}/lp-loraplane-operator/0", set())
        found = first["metadata"]["name"] in servers and router["metadata"]["name"] in routers
        return up if found and [p for p in operators if p.startswith("lp-loraplane-operator-")] else None

    up = wait_until(targets_up, timeout=60, what="Prometheus scraping the server, router and operator", interval=1)
    # the server PodMonitor selects server pods only (not the router's), the router one routers only
    assert all(
        p.startswith(f"{SERVER}-") and not p.startswith(ROUTER)
        for p in up[f"podMonitor/{NAMESPACE}/lp-loraplane-servers/0"]
    )
    assert all(p.startswith(ROUTER) for p in up[f"podMonitor/{NAMESPACE}/lp-loraplane-routers/0"])
    series = env.prometheus.query(f'loraplane_queue_depth{{namespace="{NAMESPACE}"}}')
    assert [s["metric"]["pod"] for s in series] == [first["metadata"]["name"]]
    assert series[0]["metric"]["container"] == "server" and series[0]["value"][1] == "0"
    routed = f'loraplane_router_pods{{namespace="{NAMESPACE}"}}'  # the router's view, a scrape or two later
    monitoring.wait_value(env.prometheus, routed, lambda v: v == 1, 30, "the router seeing the Ready pod")


def test_b_keda_scales_the_servers_from_1_to_3_under_queued_load_and_back(env: Env) -> None:
    (first,) = wait_replicas(env, 1, POD_START_S)
    # the operator's ScaledObject, and the HPA KEDA made of it (the external metric served by KEDA)
    scaled = env.get("scaledobject", SERVER)
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVER}
    assert scaled["metadata"]["ownerReferences"][0]["kind"] == "BaseModelServer"

    def keda_ready() -> dict[str, Any] | None:
        obj = env.get("scaledobject", SERVER)
        conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions") or []}
        return obj if conditions.get("Ready") == "True" else None

    wait_until(keda_ready, timeout=60, what="the ScaledObject Ready", interval=1)
    hpa_name = f"keda-hpa-{SERVER}"

    def reads_idle() -> dict[str, Any] | None:
        hpa = env.get("hpa", hpa_name)
        metrics = hpa.get("status", {}).get("currentMetrics") or []
        active = any(
            c["type"] == "ScalingActive" and c["status"] == "True" for c in hpa["status"].get("conditions", [])
        )
        return hpa if active and metrics and metrics[0].get("external", {}).get("current") else None

    hpa = wait_until(reads_idle, timeout=90, what="KEDA's HPA reading the queue through external.metrics.k8s.io")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["target"]["type"] == "AverageValue"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == STABILIZATION_S
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, MAX_REPLICAS)
    assert env.get("deployment", SERVER)["spec"]["replicas"] == 1

    # queued load through the router onto the one pod: the queue rises above the target, KEDA's HPA scales the
    # Deployment up (the router spreads the load over the new pods as they turn Ready)
    load = QueuedLoad(pod_url(router_pod(env)), NUM_CLIENTS)
    load.start()
    load_started = time.monotonic()
    try:
        queued = monitoring.wait_value(
            env.prometheus, queue_query(), lambda v: v > 2 * TARGET_QUEUE_DEPTH, 90, "the queue in Prometheus"
        )
        scaled_up_at = wait_deployment_replicas(env, MAX_REPLICAS, timeout=90)
        pods = wait_replicas(env, MAX_REPLICAS, POD_START_S)
        all_ready_at = time.monotonic()
        assert all(is_ready(p) and p["status"]["phase"] == "Running" for p in pods)
        wait_until(
            lambda: (env.get("bms", SERVER).get("status") or {}).get("readyReplicas") == MAX_REPLICAS,
            timeout=30,
            what="the BaseModelServer's status following the autoscaler",
        )
        assert env.get("bms", SERVER)["spec"]["replicas"] == 1  # KEDA's HPA scales the Deployment, not the spec
    finally:
        stopped_at = time.monotonic()
        load.stop()
    assert load.num_tokens > 0, load.errors[:5]
    print(
        f"queue depth seen: {queued}; Deployment at {MAX_REPLICAS} {scaled_up_at - load_started:.1f} s after the load "
        f"began, all Ready at {all_ready_at - load_started:.1f} s; {load.num_tokens} tokens streamed; errors: "
        f"{load.errors[:3]}"
    )

    # idle again: the queue drains, and after the stabilization window the HPA scales back to one pod
    monitoring.wait_value(env.prometheus, queue_query(), lambda v: v == 0, 60, "the queue back to 0")
    scaled_down_at = wait_deployment_replicas(env, 1, timeout=STABILIZATION_S + 120)
    assert scaled_down_at - stopped_at >= STABILIZATION_S - 5, "scaled down before the stabilization window"
    print(f"back to 1 replica {scaled_down_at - stopped_at:.1f} s after the load stopped")
    wait_replicas(env, 1, 120)


def test_c_every_dashboard_query_and_alert_has_series_and_the_rules_evaluate(env: Env) -> None:
    """The chart's dashboard and alerts, evaluated in the Prometheus that scraped this namespace's pods (after the
    scenarios above: requests served, adapters prewarmed, pods scaled, one adapter Failed)."""
    wait_replicas(env, 1, POD_START_S)
    wait_until(
        lambda: env.get("loraadapter", "refused").get("status", {}).get("phase") == "Failed",
        timeout=60,
        what="the refused adapter Failed",
    )
    (cm,) = [d for d in env.chart if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    dashboard = json.loads(cm["data"]["loraplane.json"])
    queries = monitoring.dashboard_queries(dashboard)
    assert len(queries) >= 25
    empty = []
    for title, expr in queries:
        concrete = expr.replace("$__rate_interval", "5m").replace("$namespace", NAMESPACE)
        if not env.prometheus.query(concrete):  # a query Prometheus cannot parse fails inside query()
            empty.append((title, concrete))
    assert not empty, f"dashboard queries with no series: {empty}"
    # every metric the README names has series too (the speculative-decoding counters, per adapter and method,
    # appear with the first speculated request; these servers do not speculate)
    named = set(re.findall(r"loraplane_[a-z_]+", (REPO_ROOT / "README.md").read_text()))
    sources = "".join((REPO_ROOT / f).read_text() for f in METRIC_SOURCES)
    metrics = {n for n in named if re.search(rf'"{n.removesuffix("_total")}(_total)?"', sources)}
    speculation = {m for m in metrics if m.startswith("loraplane_spec_")}
    missing = [
        m
        for m in sorted(metrics - speculation)
        if not env.prometheus.query(f'count({{__name__=~"{m}(_total|_bucket)?"}})')
    ]
    assert len(metrics) >= 10 and not missing, f"metrics the README names with no series in Prometheus: {missing}"
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "namespace")
    metric = variable["definition"].removeprefix("label_values(").split(",")[0]
    assert NAMESPACE in env.prometheus.api("label/namespace/values", **{"match[]": metric})

    (rule,) = [d for d in env.chart if d["kind"] == "PrometheusRule"]
    for alert in rule["spec"]["groups"][0]["rules"]:
        env.prometheus.query(alert["expr"])  # parses (a healthy pool returns nothing: the alert is not firing)
        for metric in sorted(set(re.findall(r"loraplane_[a-z_]+", alert["expr"]))):  # what it reads exists
            assert env.prometheus.query(f"count({metric})"), (alert["alert"], metric)

    def evaluated() -> list[dict[str, Any]] | None:
        groups = env.prometheus.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_until(evaluated, timeout=30, what="every rule evaluated", interval=1)
    assert {r["name"] for r in rules} == {a["alert"] for a in rule["spec"]["groups"][0]["rules"]}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # one fires for real: the adapter the server's allowlist refused (the chart's `for` set to 0s here)
    wait_until(lambda: "LoraplaneAdapterFailed" in env.prometheus.firing(), timeout=30, what="the alert firing")
    (alert,) = [
        a for a in env.prometheus.api("alerts")["alerts"] if a["labels"]["alertname"] == "LoraplaneAdapterFailed"
    ]
    assert alert["labels"]["exported_namespace"] == NAMESPACE and float(alert["value"]) == 1


def test_d_a_pool_at_zero_wakes_on_a_held_request_and_serves_it(env: Env) -> None:
    router = router_pod(env)
    patch = {"spec": {"autoscaling": {"minReplicas": 0}}}
    env.kubectl("patch", "bms", SERVER, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))
    wait_until(
        lambda: env.get("scaledobject", SERVER)["spec"]["minReplicaCount"] == 0,
        timeout=30,
        what="the operator's ScaledObject at minReplicaCount 0",
    )
    triggers = [t["name"] for t in env.get("scaledobject", SERVER)["spec"]["triggers"]]
    assert triggers == ["queue", "held", "running"]
    # idle for the cool-down: KEDA scales the Deployment to zero, the router keeps answering /ready
    wait_deployment_replicas(env, 0, timeout=STABILIZATION_S + 120)
    wait_replicas(env, 0, 120)
    ready = requests.get(f"{pod_url(router)}/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["pods"] == []

    # the first request: held by the router, its count in Prometheus, KEDA activates, the pod starts and serves it
    answers: list[requests.Response] = []
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    started = time.monotonic()
    client = threading.Thread(
        target=lambda: answers.append(
            requests.post(f"{pod_url(router)}/v1/completions", json=body, timeout=POD_START_S)
        )
    )
    client.start()
    held = f'sum(loraplane_router_held_requests{{namespace="{NAMESPACE}"}})'
    monitoring.wait_value(env.prometheus, held, lambda v: v == 1, 30, "the held request in Prometheus")
    wait_deployment_replicas(env, 1, timeout=60)
    client.join(POD_START_S)
    assert answers, "the held request got no answer"
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"].startswith(" Paris")
    assert answer.headers["x-loraplane-pod"].startswith(f"{SERVER}-")
    waited = time.monotonic() - started
    print(f"woken from zero and answered in {waited:.1f} s")
    (pod,) = wait_replicas(env, 1, 60)
    assert answer.headers["x-loraplane-pod"] == pod["metadata"]["name"]
    monitoring.wait_value(env.prometheus, held, lambda v: v == 0, 30, "no request held")
    histogram = f'sum(loraplane_router_held_seconds_count{{namespace="{NAMESPACE}"}})'
    assert monitoring.wait_value(env.prometheus, histogram, lambda v: v >= 1, 30, "the wait recorded") == 1
