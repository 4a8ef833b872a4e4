"""Issue 20 on the local control plane: a BaseModelServer with spec.router runs `loraplane router` pods (found
through the API server with their own least-privilege ServiceAccount); LoRAAdapters with prewarm.replicas: 1
are placed on the pod their rendezvous ranking puts first, and requests through either router pod go to that
same pod, so each adapter loads on one pod only; switching the router off deletes its objects."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from e2e.cluster import LocalCluster
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import (
    CRD_DIR,
    OperatorProcess,
    adapter_manifest,
    adapter_rows,
    diagnostics,
    install_operator_rbac,
    is_ready,
    local_server_sample,
    pod_url,
    ready_server_pods,
    snapshot_adapters,
)
from loraplane_server.router.ranking import rank

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-router"
SERVER = "routed"
REPLICAS = 2
POD_START_S = 480.0
ROUTER_LABEL = "loraplane.dev/router"
SOURCES = ("french", "pirate", "json")
NUM_ADAPTERS = 6  # ids over the three example adapters, chosen once the pods are known (see pick_adapters)
ADAPTERS: list[str] = []
PROMPT = "Hello, my name is"


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    operator: OperatorProcess

    def server_pods(self) -> list[dict[str, Any]]:
        return ready_server_pods(self.kubectl, NAMESPACE, SERVER)

    def router_pods(self) -> list[dict[str, Any]]:
        pods = self.kubectl.json("get", "pods", "-n", NAMESPACE, "-l", f"{ROUTER_LABEL}={SERVER}")["items"]
        return [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    kubectl("apply", "-f", str(CRD_DIR))
    for crd in ("basemodelservers.loraplane.dev", "loraadapters.loraplane.dev"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    kubeconfig = install_operator_rbac(kubectl, cluster)
    work = Path(tmp_path_factory.mktemp("router"))
    adapters_dir = snapshot_adapters(work / "adapters")
    operator = OperatorProcess(kubeconfig, work / "operator.log")
    kubectl("create", "namespace", NAMESPACE)
    environment = Env(kubectl, cluster, operator)
    operator.start()
    try:
        operator.wait_started()
        server = local_server_sample(adapters_dir, replicas=REPLICAS)
        server["metadata"]["name"] = SERVER
        server["spec"]["router"] = {
            "enabled": True,
            "replicas": 2,
            "command": [sys.executable, "-m", "loraplane_server.cli", "router"],
        }
        kubectl.apply(server, NAMESPACE)
        try:
            wait_until(
                lambda: len(environment.server_pods()) == REPLICAS and len(environment.router_pods()) == 2,
                timeout=POD_START_S,
                what=f"{REPLICAS} server pods and 2 router pods Ready",
            )
        except TimeoutError as error:
            raise TimeoutError(f"{error}\n{diagnostics(kubectl, cluster, operator, NAMESPACE)}") from None
        ADAPTERS[:] = pick_adapters([p["metadata"]["name"] for p in environment.server_pods()])
        for i, name in enumerate(ADAPTERS):
            manifest = adapter_manifest(name, SERVER, str(adapters_dir / SOURCES[i % len(SOURCES)]), tier="host")
            manifest["spec"]["prewarm"]["replicas"] = 1
            kubectl.apply(manifest, NAMESPACE)
        yield environment
    finally:
        try:
            kubectl("delete", "lora", "--all", "-n", NAMESPACE, "--wait=false")
            wait_until(lambda: not kubectl.json("get", "lora", "-n", NAMESPACE)["items"], timeout=60, what="no lora")
        finally:
            operator.stop()
            kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def pick_adapters(pods: list[str]) -> list[str]:
    """NUM_ADAPTERS ids, half of them ranked first on each pod (pod names are random: a fixed set of ids could
    rank one pod first for all of them, and the test would show nothing about the other)."""
    per_pod: dict[str, list[str]] = {p: [] for p in pods}
    for i in range(1000):
        name = f"tenant-{i}"
        first = per_pod[rank(name, pods)[0]]
        if len(first) < NUM_ADAPTERS // len(pods):
            first.append(name)
    return sorted(a for names in per_pod.values() for a in names)


def homes(env: Env) -> dict[str, str]:
    names = [p["metadata"]["name"] for p in env.server_pods()]
    return {a: rank(a, names)[0] for a in ADAPTERS}


def warm_on(pod: dict[str, Any]) -> set[str]:
    return {a for a, row in adapter_rows(pod).items() if row.get("tier") in ("device", "host")}


def test_a_router_pods_run_with_their_own_least_privilege_account(env: Env) -> None:
    name = f"{SERVER}-router"
    role = env.kubectl.json("get", "role", name, "-n", NAMESPACE)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert env.kubectl.json("get", "serviceaccount", name, "-n", NAMESPACE)["metadata"]["name"] == name
    service = env.kubectl.json("get", "service", name, "-n", NAMESPACE)
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "loraplane-server", ROUTER_LABEL: SERVER}
    account = f"--as=system:serviceaccount:{NAMESPACE}:{name}"
    assert env.kubectl("auth", "can-i", "list", "pods", "-n", NAMESPACE, account).strip() == "yes"
    with pytest.raises(KubectlError):  # "no" exits 1
        env.kubectl("auth", "can-i", "get", "secrets", "-n", NAMESPACE, account)
    for pod in env.router_pods():  # each router found both server pods through the API server
        ready = requests.get(f"{pod_url(pod)}/ready", timeout=5).json()
        assert sorted(ready["pods"]) == sorted(p["metadata"]["name"] for p in env.server_pods()), ready


def test_b_placement_and_both_routers_agree_on_each_adapters_pod(env: Env) -> None:
    home = homes(env)
    assert len(ADAPTERS) == NUM_ADAPTERS and len(set(home.values())) == REPLICAS, home  # both pods are home
    by_name = {p["metadata"]["name"]: p for p in env.server_pods()}

    def placed() -> bool:
        for name in ADAPTERS:
            status = env.kubectl.json("get", "lora", name, "-n", NAMESPACE).get("status") or {}
            chosen = [e["pod"] for e in status.get("residency") or [] if e.get("tier") in ("device", "host")]
            if status.get("phase") != "Ready" or chosen != [home[name]]:
                return False
        return True

    wait_until(placed, timeout=120, what="each adapter prewarmed on its first-ranked pod only", interval=1)
    for pod_name, pod in by_name.items():  # the pods say the same as the status
        assert warm_on(pod) == {a for a in ADAPTERS if home[a] == pod_name}
    texts: dict[str, set[str]] = {a: set() for a in ADAPTERS}
    started = time.monotonic()
    for router in env.router_pods():
        for name in ADAPTERS:
            body = {"model": name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
            r = requests.post(f"{pod_url(router)}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts[name].add(r.json()["choices"][0]["text"])
    print(f"{2 * len(ADAPTERS)} requests through the routers in {time.monotonic() - started:.1f}s")
    assert all(len(t) == 1 for t in texts.values()), texts  # greedy: both routers, the same answer
    for pod_name, pod in by_name.items():  # no adapter was loaded on a second pod by the traffic
        assert warm_on(pod) == {a for a in ADAPTERS if home[a] == pod_name}, pod_name
    for router in env.router_pods():
        metrics = requests.get(f"{pod_url(router)}/metrics", timeout=5).text
        routed = [line for line in metrics.splitlines() if line.startswith("loraplane_router_requests_total{")]
        assert routed and all('resident="yes"' in line for line in routed), routed


def test_c_switching_the_router_off_deletes_it(env: Env) -> None:
    patch = json.dumps({"spec": {"router": {"enabled": False}}})
    env.kubectl("patch", "bms", SERVER, "-n", NAMESPACE, "--type=merge", "-p", patch)

    def gone() -> bool:
        kinds = ("deployment", "service", "role", "rolebinding", "serviceaccount")
        found = env.kubectl("get", ",".join(kinds), "-n", NAMESPACE, "-l", f"{ROUTER_LABEL}={SERVER}", "-o", "name")
        return found.strip() == ""

    wait_until(gone, timeout=60, what="the router's objects deleted")
    assert len(env.server_pods()) == REPLICAS  # the servers stay
