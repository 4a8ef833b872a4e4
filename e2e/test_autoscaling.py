"""Autoscaling on queue depth with the real HPA controller: a BaseModelServer with spec.autoscaling gets an
autoscaling/v2 HPA from the operator; the kube-controller-manager's HPA controller reads
loraplane_queue_depth through the aggregated custom.metrics.k8s.io API, served by e2e/custom_metrics.py
(registered as an APIService behind an ExternalName Service); queued requests scale the server Deployment
up, and idleness scales it back down after the spec's stabilization window."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from e2e.cluster import FRONT_PROXY_CLIENT, HPA_SYNC_PERIOD, REPO_ROOT, LocalCluster, free_port
from e2e.custom_metrics import GROUP, GROUP_VERSION, METRIC, VERSION, registration_manifests
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import (
    SERVER_LABEL,
    OperatorProcess,
    diagnostics,
    install_crds,
    install_operator_rbac,
    is_ready,
    local_server_sample,
    pod_url,
    ready_server_pods,
    server_pods,
    snapshot_adapters,
)
from e2e.process import spawn, stop

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-autoscaling"
SERVER = "scaler"
METRICS_NAMESPACE = "e2e-custom-metrics"
METRICS_SERVICE = "custom-metrics-apiserver"
APISERVICE = f"{VERSION}.{GROUP}"
HPA_ACCOUNT = "system:serviceaccount:kube-system:horizontal-pod-autoscaler"
TARGET_QUEUE_DEPTH = 2
MAX_REPLICAS = 2
STABILIZATION_S = 10
MAX_NUM_SEQS = 2  # one pod runs two requests; the other clients wait in its queue
NUM_CLIENTS = 8  # so the queue holds about 6 (> TARGET_QUEUE_DEPTH), and the HPA wants more pods
MAX_TOKENS = 300
POD_START_S = 240.0
SYNC_S = float(HPA_SYNC_PERIOD.removesuffix("s"))


# the custom metrics API


@pytest.fixture(scope="module")
def metrics_log(cluster: LocalCluster, kubectl: Kubectl) -> Iterator[Path]:
    """e2e/custom_metrics.py as a child process, registered as the APIService v1beta2.custom.metrics.k8s.io
    (its serving cert checked against the cluster CA); its log, one line per metrics request."""
    port = free_port()
    dns = [f"{METRICS_SERVICE}.{METRICS_NAMESPACE}.svc", "localhost"]
    cert, key = cluster.pki.serving_cert("custom-metrics", dns, ["127.0.0.1"])
    log = cluster.log_dir / "custom-metrics.log"
    argv = [sys.executable, "-m", "e2e.custom_metrics", "--kubeconfig", str(cluster.kubeconfig)]
    argv += ["--port", str(port), "--cert", str(cert), "--key", str(key)]
    argv += ["--client-ca", str(cluster.front_proxy_pki.ca_file), "--allowed-name", FRONT_PROXY_CLIENT]
    process = spawn(argv, log, cwd=REPO_ROOT)
    try:
        for manifest in registration_manifests(METRICS_NAMESPACE, METRICS_SERVICE, port, cluster.pki.ca_file):
            kubectl.apply(manifest)
        kubectl("wait", "--for=condition=Available", f"apiservice/{APISERVICE}", "--timeout=60s")
        yield log
    finally:
        for args in (("apiservice", APISERVICE), ("namespace", METRICS_NAMESPACE)):
            try:
                kubectl("delete", *args, "--wait=false")
            except KubectlError:
                pass
        stop(process)


def raw_metric(kubectl: Kubectl, namespace: str, selector: str) -> dict[str, float]:
    """pod name -> loraplane_queue_depth, through the API server and the aggregator, as the HPA reads it."""
    path = f"/apis/{GROUP_VERSION}/namespaces/{namespace}/pods/*/{METRIC}?labelSelector={selector}"
    answer = json.loads(kubectl("get", "--raw", path))
    assert answer["kind"] == "MetricValueList", answer
    return {i["describedObject"]["name"]: _quantity(i["value"]) for i in answer["items"]}


def _quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_a_custom_metrics_api_is_served_through_the_aggregator(
    kubectl: Kubectl, cluster: LocalCluster, metrics_log: Path
) -> None:
    apiservice = kubectl.json("get", "apiservice", APISERVICE)
    available = next(c for c in apiservice["status"]["conditions"] if c["type"] == "Available")
    assert available["status"] == "True", available
    resources = json.loads(kubectl("get", "--raw", f"/apis/{GROUP_VERSION}"))["resources"]
    assert [r["name"] for r in resources] == [f"pods/{METRIC}"]
    assert GROUP_VERSION in kubectl("api-versions").split()
    # a namespace without pods: an empty list, not an error
    assert raw_metric(kubectl, "default", "app=nothing-here") == {}
    assert "metrics request user=loraplane-admin" in metrics_log.read_text()
    # only the aggregator's proxy client (a front-proxy CA cert) may call the server directly
    url = f"https://127.0.0.1:{apiservice['spec']['service']['port']}/apis/{GROUP_VERSION}"
    proxy_client = cluster.front_proxy_pki.directory / f"{FRONT_PROXY_CLIENT}.crt"
    proxy_key = proxy_client.with_suffix(".key")
    with requests.Session() as session:
        session.trust_env = False
        session.verify = str(cluster.pki.ca_file)  # the serving cert is the cluster CA's, for localhost too
        assert session.get(url, cert=(str(proxy_client), str(proxy_key)), timeout=5).status_code == 200
        for cert in (None, (str(cluster.pki.directory / "admin.crt"), str(cluster.pki.directory / "admin.key"))):
            with pytest.raises(requests.exceptions.ConnectionError):  # no cert, or not the front-proxy CA's
                session.get(url, cert=cert, timeout=5)
        other = cluster.front_proxy_pki.client_cert("not-the-proxy", "not-the-proxy", [])
        assert session.get(url, cert=(str(other[0]), str(other[1])), timeout=5).status_code == 403


# the server pool and the operator


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    operator: OperatorProcess

    def get(self, *args: str) -> Any:
        return self.kubectl.json("get", *args, "-n", NAMESPACE)


@pytest.fixture(scope="module")
def env(
    kubectl: Kubectl, cluster: LocalCluster, metrics_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    install_crds(kubectl)
    kubeconfig = install_operator_rbac(kubectl, cluster)
    work = Path(tmp_path_factory.mktemp("autoscaling"))
    operator = OperatorProcess(kubeconfig, work / "operator.log")
    kubectl("create", "namespace", NAMESPACE)
    operator.start()
    environment = Env(kubectl, cluster, operator)
    try:
        operator.wait_started()
        kubectl.apply(server_manifest(snapshot_adapters(work / "adapters")), NAMESPACE)
        yield environment
    finally:
        try:
            kubectl("delete", "bms", SERVER, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
        except KubectlError:
            pass
        operator.stop()
        kubectl("delete", "namespace", NAMESPACE, "--wait=false")


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, kubectl: Kubectl, cluster: LocalCluster) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        env: Env | None = request.node.funcargs.get("env")
        text = diagnostics(kubectl, cluster, env.operator if env else None, NAMESPACE)
        text += f"\n--- hpa ---\n{_safe(kubectl, 'get', 'hpa', '-n', NAMESPACE, '-o', 'yaml')}"
        text += f"\n--- kube-controller-manager ---\n{cluster.log_tail('kube-controller-manager', 30)}"
        text += f"\n--- custom-metrics ---\n{cluster.log_tail('custom-metrics', 30)}"
        print(f"\n===== diagnostics after {request.node.name} =====\n{text}")


def _safe(kubectl: Kubectl, *args: str) -> str:
    try:
        return kubectl(*args)
    except KubectlError as error:
        return str(error)


def server_manifest(adapters_dir: Path) -> dict[str, Any]:
    """A one-pod server on the process kubelet (one torch thread per pod: the machine may have two cores),
    autoscaled between 1 and MAX_REPLICAS on loraplane_queue_depth."""
    bms = local_server_sample(adapters_dir, replicas=1)
    bms["metadata"]["name"] = SERVER
    bms["spec"]["engine"].update(maxNumSeqs=MAX_NUM_SEQS, kvCacheGiB=0.1)
    bms["spec"]["args"] += ["--torch-threads", "1"]
    bms["spec"]["autoscaling"] = {
        "enabled": True,
        "kind": "hpa",
        "minReplicas": 1,
        "maxReplicas": MAX_REPLICAS,
        "targetQueueDepth": TARGET_QUEUE_DEPTH,
        "scaleDownStabilizationSeconds": STABILIZATION_S,
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


# the test


def wait_replicas(env: Env, replicas: int, timeout: float) -> list[dict[str, Any]]:
    """The Deployment at `replicas` and exactly that many server pods Ready (none left terminating)."""

    def settled() -> list[dict[str, Any]] | None:
        spec_replicas = env.get("deployment", SERVER)["spec"]["replicas"]
        pods = server_pods(env.kubectl, NAMESPACE, SERVER)
        ready = ready_server_pods(env.kubectl, NAMESPACE, SERVER)
        all_pods = env.get("pods", "-l", f"{SERVER_LABEL}={SERVER}")["items"]
        if spec_replicas == replicas and len(ready) == len(pods) == len(all_pods) == replicas:
            return ready
        return None

    return wait_until(settled, timeout=timeout, what=f"{replicas} server pods Ready", interval=1)


def wait_deployment_replicas(env: Env, replicas: int, timeout: float) -> float:
    """Until the Deployment's spec.replicas (what the HPA sets) is `replicas`; the monotonic time then."""

    def scaled() -> float | None:
        return time.monotonic() if env.get("deployment", SERVER)["spec"]["replicas"] == replicas else None

    return wait_until(scaled, timeout=timeout, what=f"the HPA scaling the Deployment to {replicas}", interval=1)


def hpa_condition(hpa: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in hpa.get("status", {}).get("conditions") or [] if c["type"] == kind), {})


def test_b_queue_depth_scales_the_servers_up_and_back_down(env: Env, metrics_log: Path) -> None:
    selector = f"{SERVER_LABEL}={SERVER}"
    (first,) = wait_replicas(env, 1, POD_START_S)

    # the operator's HPA: the Deployment, the Pods metric, the bounds and the stabilization window
    hpa = env.get("hpa", SERVER)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVER}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, MAX_REPLICAS)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == METRIC
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": str(TARGET_QUEUE_DEPTH)}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == STABILIZATION_S
    assert hpa["metadata"]["ownerReferences"][0]["kind"] == "BaseModelServer"

    # idle: the HPA controller reads the metric (0) through the aggregator and holds one replica
    def reads_idle() -> dict[str, Any] | None:
        hpa = env.get("hpa", SERVER)
        current = (hpa.get("status", {}).get("currentMetrics") or [{}])[0].get("pods", {}).get("current", {})
        active = hpa_condition(hpa, "ScalingActive").get("status") == "True"
        return hpa if active and current.get("averageValue") == "0" else None

    wait_until(reads_idle, timeout=60, what="the HPA reading loraplane_queue_depth 0", interval=1)
    assert env.get("deployment", SERVER)["spec"]["replicas"] == 1
    assert f"user={HPA_ACCOUNT} namespace={NAMESPACE}" in metrics_log.read_text()

    # queued load on the one pod: the queue rises above the target, the HPA scales the Deployment up
    load = QueuedLoad(pod_url(first), NUM_CLIENTS)
    load.start()
    try:

        def queue_above_target() -> dict[str, float] | None:
            values = raw_metric(env.kubectl, NAMESPACE, selector)
            return values if values.get(first["metadata"]["name"], 0) > TARGET_QUEUE_DEPTH else None

        queued = wait_until(queue_above_target, timeout=60, what=f"{METRIC} above {TARGET_QUEUE_DEPTH}")
        wait_deployment_replicas(env, MAX_REPLICAS, timeout=60)
        pods = wait_replicas(env, MAX_REPLICAS, POD_START_S)
        hpa = env.get("hpa", SERVER)
        assert hpa["status"]["desiredReplicas"] == MAX_REPLICAS and hpa["status"].get("lastScaleTime")
        assert all(is_ready(p) and p["status"]["phase"] == "Running" for p in pods)
        wait_until(
            lambda: (env.get("bms", SERVER).get("status") or {}).get("readyReplicas") == MAX_REPLICAS,
            timeout=30,
            what="the BaseModelServer's status following the HPA",
        )
        assert env.get("bms", SERVER)["spec"]["replicas"] == 1  # the HPA scales the Deployment, not the spec
    finally:
        stopped_at = time.monotonic()
        load.stop()
    assert load.num_tokens > 0, load.errors[:5]
    print(f"queue depth seen: {queued}; {load.num_tokens} tokens streamed; errors: {load.errors[:3]}")

    # idle again: the queue drains, and after the stabilization window the HPA scales back to one pod
    wait_until(
        lambda: all(v == 0 for v in raw_metric(env.kubectl, NAMESPACE, selector).values()),
        timeout=60,
        what=f"{METRIC} back to 0 on every pod",
    )
    scaled_down_at = wait_deployment_replicas(env, 1, timeout=STABILIZATION_S + 90)
    assert scaled_down_at - stopped_at >= STABILIZATION_S - SYNC_S, "scaled down before the stabilization window"
    wait_replicas(env, 1, 120)
    hpa = env.get("hpa", SERVER)
    assert hpa["status"]["desiredReplicas"] == 1
