"""Smoke tests: the local control plane is a real Kubernetes (API server, RBAC, controllers, our kubelet)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.api import ApiClient, ApiError, http_get
from e2e.cluster import LocalCluster
from e2e.kubectl import Kubectl, KubectlError, wait_until

pytestmark = pytest.mark.e2e


def web_deployment(name: str, replicas: int) -> dict[str, Any]:
    """A tiny HTTP server on the pod's own address, ready when it answers GET /."""
    container = {
        "name": "http",
        "image": "python:3-slim",
        "command": ["python", "-m", "http.server"],
        "args": ["--bind", "$(POD_IP)", "8000"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    pod_spec = {"terminationGracePeriodSeconds": 5, "containers": [container]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
        },
    }


def pods_of(kubectl: Kubectl, namespace: str, app: str) -> list[dict[str, Any]]:
    return kubectl.json("get", "pods", "-n", namespace, "-l", f"app={app}")["items"]


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pid_of(pod: dict[str, Any]) -> int:
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("process://"), container_id
    return int(container_id.removeprefix("process://"))


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def deploy_and_wait(kubectl: Kubectl, namespace: str, name: str, replicas: int) -> list[dict[str, Any]]:
    kubectl.apply(web_deployment(name, replicas), namespace)

    def ready_pods() -> list[dict[str, Any]] | None:
        deployment = kubectl.json("get", "deployment", name, "-n", namespace)
        if deployment.get("status", {}).get("readyReplicas") != replicas:
            return None
        pods = [p for p in pods_of(kubectl, namespace, name) if is_ready(p)]
        return pods if len(pods) == replicas else None

    return wait_until(ready_pods, timeout=90, what=f"deployment {name} {replicas}/{replicas} ready")


@pytest.fixture(scope="module")
def web(kubectl: Kubectl) -> Iterator[tuple[str, str]]:
    """(namespace, name) of a 2-replica web Deployment that is Ready."""
    namespace = "e2e-web"
    kubectl("create", "namespace", namespace)
    deploy_and_wait(kubectl, namespace, "web", 2)
    yield namespace, "web"
    kubectl("delete", "namespace", namespace, "--wait=false")


def test_api_server_is_ready(kubectl: Kubectl) -> None:
    assert kubectl("get", "--raw", "/readyz").strip() == "ok"


def test_node_advertises_gpus(kubectl: Kubectl, cluster: LocalCluster) -> None:
    node = kubectl.json("get", "node", str(cluster.node_name))
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert is_ready(node)


def test_rbac_denies_service_account_without_permissions(
    kubectl: Kubectl, cluster: LocalCluster, namespace: str
) -> None:
    kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    kubeconfig = cluster.service_account_kubeconfig(namespace, "nobody")
    with pytest.raises(ApiError) as denied:
        ApiClient.from_kubeconfig(kubeconfig).get(f"/api/v1/namespaces/{namespace}/pods")
    assert denied.value.status == 403
    with pytest.raises(KubectlError, match="(?i)forbidden"):
        kubectl.with_kubeconfig(kubeconfig)("get", "pods", "-n", namespace)
    # the same token works once a Role allows it: the 403 came from RBAC, not from authentication
    kubectl("create", "role", "pod-reader", "--verb=list", "--resource=pods", "-n", namespace)
    account = f"--serviceaccount={namespace}:nobody"
    kubectl("create", "rolebinding", "nobody-reads", "--role=pod-reader", account, "-n", namespace)
    wait_until(lambda: ApiClient.from_kubeconfig(kubeconfig).get(f"/api/v1/namespaces/{namespace}/pods"), 10, "RBAC")


def test_deployment_pods_run_on_their_own_addresses(
    kubectl: Kubectl, cluster: LocalCluster, web: tuple[str, str]
) -> None:
    namespace, name = web
    pods = [p for p in pods_of(kubectl, namespace, name) if is_ready(p)]
    ips = {p["status"]["podIP"] for p in pods}
    assert len(pods) == 2 and len(ips) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] == cluster.node_name
        assert pod["status"]["phase"] == "Running"
        assert pod["status"]["podIP"].startswith("127.") and pod["status"]["podIP"] != "127.0.0.1"
        assert http_get(f"http://{pod['status']['podIP']}:8000/", 5).status_code == 200


def test_killed_container_is_restarted(kubectl: Kubectl, web: tuple[str, str]) -> None:
    namespace, name = web
    pod = pods_of(kubectl, namespace, name)[0]
    pod_name, old_pid = pod["metadata"]["name"], pid_of(pod)
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        current = kubectl.json("get", "pod", pod_name, "-n", namespace)
        status = current["status"]["containerStatuses"][0]
        return current if status["restartCount"] == 1 and is_ready(current) else None

    current = wait_until(restarted, timeout=60, what=f"{pod_name} restarted and ready")
    assert pid_of(current) != old_pid
    last = current["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 137
    assert http_get(f"http://{current['status']['podIP']}:8000/", 5).status_code == 200


def test_deleting_deployment_removes_pods_and_processes(kubectl: Kubectl, namespace: str) -> None:
    pods = deploy_and_wait(kubectl, namespace, "gc-web", 2)
    pids = [pid_of(p) for p in pods]
    assert all(is_alive(pid) for pid in pids)
    kubectl("delete", "deployment", "gc-web", "-n", namespace)  # background propagation: the GC deletes the rest
    wait_until(lambda: not pods_of(kubectl, namespace, "gc-web"), timeout=60, what="pods garbage-collected")
    wait_until(lambda: not any(is_alive(pid) for pid in pids), timeout=20, what="pod processes gone")
    wait_until(lambda: not kubectl.json("get", "replicasets", "-n", namespace)["items"], 30, "replicasets gone")


def test_pod_runs_as_its_service_account(kubectl: Kubectl, cluster: LocalCluster, namespace: str) -> None:
    """The kubelet hands each pod a KUBECONFIG with a token of its ServiceAccount, so in-pod clients get RBAC."""
    kubectl("create", "serviceaccount", "worker", "-n", namespace)
    whoami = ["kubectl", "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"]
    container = {"name": "whoami", "image": "bitnami/kubectl", "command": whoami}
    spec = {"serviceAccountName": "worker", "restartPolicy": "Never", "containers": [container]}
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whoami"}, "spec": spec}, namespace)

    def phase() -> str:
        return kubectl("get", "pod", "whoami", "-n", namespace, "-o", "jsonpath={.status.phase}")

    assert wait_until(lambda: phase() in ("Succeeded", "Failed") and phase(), 60, "pod finished") == "Succeeded"
    assert cluster.pod_log(namespace, "whoami", "whoami").strip() == f"system:serviceaccount:{namespace}:worker"


def test_pod_asking_for_too_many_gpus_stays_pending(kubectl: Kubectl, namespace: str) -> None:
    container = {
        "name": "c",
        "image": "none",
        "command": ["sleep", "60"],
        "resources": {"limits": {"nvidia.com/gpu": "9"}},
    }
    kubectl.apply(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "greedy"}, "spec": {"containers": [container]}},
        namespace,
    )

    def unschedulable() -> bool:
        pod = kubectl.json("get", "pod", "greedy", "-n", namespace)
        conditions = pod.get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    wait_until(unschedulable, timeout=30, what="PodScheduled=False Unschedulable")
    assert not kubectl.json("get", "pod", "greedy", "-n", namespace)["spec"].get("nodeName")
