"""The operator end to end: CRDs and samples applied with kubectl, the operator running under its chart's RBAC
(a ServiceAccount, not cluster admin), real server pods on the process kubelet, real adapters prewarmed
through the pods' admin API. One cluster, one namespace and one operator for the whole module; the tests
run in order and build on each other (a: CRDs ... h: scale)."""

from __future__ import annotations

import base64
import copy
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from e2e.cluster import LocalCluster
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import (
    ADAPTER_NAMES,
    ADMIN_PORT,
    FINALIZER,
    SERVER_LABEL,
    OperatorProcess,
    adapter_manifest,
    adapter_rows,
    admin_headers,
    complete_ids,
    diagnostics,
    http_status,
    install_crds,
    install_operator_rbac,
    is_ready,
    list_adapters,
    local_adapter_sample,
    local_server_sample,
    pid_of,
    pod_security_verdict,
    pod_url,
    rbac_rules_from_yaml,
    ready_server_pods,
    reference_greedy,
    restart_count,
    server_pods,
    snapshot_adapters,
)
from loraplane_operator import builders

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-operator"
SERVER = "smollm2"
PROMPT = "Hello, my name is"
MAX_TOKENS = 10
BASE = "smollm2-135m"
BROKEN = "broken"
EXPECTED_TIER = {"french": "device", "pirate": "host", "json": "device"}
POD_START_S = 240.0  # a server pod loads the model in 10-30 s on 2 shared cores; several may start at once
TIER_RANK = {"device": 0, "host": 1, "disk": 2}


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    operator: OperatorProcess
    namespace: str
    adapters_dir: Path  # a snapshot of server/examples/adapters
    prompt_ids: list[int] = field(default_factory=list)  # PROMPT's token ids, set by scenario c
    outputs: dict[str, str] = field(default_factory=dict)  # adapter id (or BASE) -> greedy text, from scenario c

    def complete(self, pod: dict[str, Any], model: str) -> str:
        return complete_ids(pod, model, self.prompt_ids, MAX_TOKENS)

    def get(self, *args: str) -> Any:
        return self.kubectl.json("get", *args, "-n", self.namespace)

    def lora(self, name: str) -> dict[str, Any]:
        return self.get("lora", name)

    def bms(self) -> dict[str, Any]:
        return self.get("bms", SERVER)


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    install_crds(kubectl)
    kubeconfig = install_operator_rbac(kubectl, cluster)
    log_dir = Path(tmp_path_factory.mktemp("operator"))
    adapters_dir = snapshot_adapters(log_dir / "adapters")
    operator = OperatorProcess(kubeconfig, log_dir / "operator.log")
    kubectl("create", "namespace", NAMESPACE)
    operator.start()
    environment = Env(kubectl, cluster, operator, NAMESPACE, adapters_dir)
    try:
        operator.wait_started()
        yield environment
    finally:
        _teardown(environment)


def _teardown(env: Env) -> None:
    """Delete the adapters while the operator runs (it unloads and drops the finalizers), then the rest."""
    kubectl = env.kubectl
    try:
        if not env.operator.is_running:
            env.operator.start()
        kubectl("delete", "lora", "--all", "-n", env.namespace, "--wait=false")
        wait_until(lambda: not env.get("lora")["items"], timeout=60, what="adapters deleted")
    except Exception:  # noqa: BLE001 - never leave the namespace stuck on our finalizers
        for item in env.get("lora")["items"]:
            name = item["metadata"]["name"]
            patch = json.dumps({"metadata": {"finalizers": None}})
            try:
                kubectl("patch", "lora", name, "-n", env.namespace, "--type=merge", "-p", patch)
            except KubectlError:
                pass
    finally:
        env.operator.stop()
        kubectl("delete", "namespace", env.namespace, "--wait=false")


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, env: Env) -> Iterator[None]:
    """Prints the operator log, the resources and the pod logs when this test failed."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        text = diagnostics(env.kubectl, env.cluster, env.operator, env.namespace)
        if reporter is not None:
            reporter.write_line(f"\n===== diagnostics after {request.node.name} =====\n{text}")
        else:
            print(text)


# helpers


def adapter_ready_on(env: Env, name: str, pods: list[str], tier: str | None = None) -> dict[str, Any] | None:
    """The LoRAAdapter once it is Ready with residency on exactly `pods` (at `tier` or warmer)."""
    lora = env.lora(name)
    status = lora.get("status") or {}
    if status.get("phase") != "Ready" or status.get("observedGeneration") != lora["metadata"]["generation"]:
        return None
    residency = {e["pod"]: e for e in status.get("residency") or []}
    if sorted(residency) != sorted(pods):
        return None
    for entry in residency.values():
        if entry.get("state") != "ready":
            return None
        if tier is not None and TIER_RANK.get(entry.get("tier", ""), 9) > TIER_RANK[tier]:
            return None
    if status.get("readyReplicas") != len(pods) or status.get("desiredReplicas") != len(pods):
        return None
    return lora


def wait_server_ready(env: Env, replicas: int, timeout: float = POD_START_S) -> list[dict[str, Any]]:
    """Deployment rolled out, `replicas` pods Ready, the BaseModelServer's status Ready with replicas/replicas."""

    def ready() -> list[dict[str, Any]] | None:
        pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
        if len(pods) != replicas or len(server_pods(env.kubectl, env.namespace, SERVER)) != replicas:
            return None
        status = env.bms().get("status") or {}
        if (status.get("phase"), status.get("replicas"), status.get("readyReplicas")) != ("Ready", replicas, replicas):
            return None
        return pods

    return wait_until(ready, timeout=timeout, what=f"BaseModelServer {SERVER} {replicas}/{replicas} Ready")


def wait_adapters_on(env: Env, names: list[str], pods: list[str], timeout: float = 120.0) -> None:
    for name in names:
        wait_until(
            lambda name=name: adapter_ready_on(env, name, pods, EXPECTED_TIER.get(name)),
            timeout=timeout,
            what=f"LoRAAdapter {name} Ready on {pods}",
        )


def pod_holds(pod: dict[str, Any], name: str) -> bool:
    row = adapter_rows(pod).get(name)
    return bool(row) and row["state"] == "ready" and TIER_RANK.get(row["tier"], 9) <= TIER_RANK[EXPECTED_TIER[name]]


def names(pods: list[dict[str, Any]]) -> list[str]:
    return sorted(p["metadata"]["name"] for p in pods)


def assert_single_children(env: Env) -> None:
    """Exactly one Deployment and one Service, each owned (once) by the BaseModelServer."""
    bms_uid = env.bms()["metadata"]["uid"]
    for kind in ("deployments", "services"):
        items = env.get(kind, "-l", f"{SERVER_LABEL}={SERVER}")["items"]
        assert [i["metadata"]["name"] for i in items] == [SERVER], f"{kind}: {[i['metadata']['name'] for i in items]}"
        owners = items[0]["metadata"].get("ownerReferences") or []
        assert [(o["kind"], o["uid"], o.get("controller")) for o in owners] == [("BaseModelServer", bms_uid, True)]


def assert_resident_once(pods: list[dict[str, Any]], wanted: list[str]) -> None:
    for pod in pods:
        ids = [row["id"] for row in list_adapters(pod)]
        assert len(ids) == len(set(ids)), f"{pod['metadata']['name']} lists an adapter twice: {ids}"
        for name in wanted:
            assert pod_holds(pod, name), f"{name} not resident on {pod['metadata']['name']}: {adapter_rows(pod)}"


# a. CRDs and samples


def test_a_crds_and_samples_apply_and_schema_rejects_invalid(env: Env) -> None:
    kubectl = env.kubectl
    crds = kubectl.json("get", "crd", "-l", "app.kubernetes.io/part-of=loraplane")["items"]
    assert sorted(c["metadata"]["name"] for c in crds) == [
        "basemodelservers.loraplane.dev",
        "loraadapters.loraplane.dev",
    ]
    # short names and the operator's RBAC as the chart grants it (the YAML and the Python rules agree)
    assert kubectl("api-resources", "--api-group=loraplane.dev", "-o", "name").split() == [
        "basemodelservers.loraplane.dev",
        "loraadapters.loraplane.dev",
    ]
    role = kubectl.json("get", "clusterrole", "loraplane-operator")
    assert [
        {k: r.get(k, []) for k in ("apiGroups", "resources", "verbs")} for r in role["rules"]
    ] == rbac_rules_from_yaml()
    who = kubectl.with_kubeconfig(env.operator.kubeconfig)(
        "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"
    )
    assert who == "system:serviceaccount:loraplane-system:loraplane-operator"

    # the samples, pointed at the real example adapters and made to run on the process kubelet
    env.kubectl.apply(local_server_sample(env.adapters_dir, replicas=2), env.namespace)
    for name in ADAPTER_NAMES:
        env.kubectl.apply(local_adapter_sample(name, env.adapters_dir), env.namespace)
    assert (
        kubectl("get", "bms", SERVER, "-n", env.namespace, "-o", "name").strip()
        == f"basemodelserver.loraplane.dev/{SERVER}"
    )
    assert sorted(kubectl("get", "lora", "-n", env.namespace, "-o", "name").split()) == sorted(
        f"loraadapter.loraplane.dev/{n}" for n in ADAPTER_NAMES
    )
    # CRD defaults were applied by the API server
    bms = env.bms()
    assert bms["spec"]["port"] == 8080 and bms["spec"]["imagePullPolicy"] == "IfNotPresent"

    # invalid resources are rejected by the API server with the schema's messages
    bad_source = adapter_manifest("bad-source", SERVER, "relative/path")
    with pytest.raises(KubectlError) as rejected:
        kubectl.apply(bad_source, env.namespace)
    assert "source must be an absolute path or start with file:///, hf://, s3://, http:// or https://" in str(
        rejected.value
    )
    bad_tier = adapter_manifest("bad-tier", SERVER, str(env.adapters_dir / "french"), tier="gpu")
    with pytest.raises(KubectlError, match=r"prewarm.tier must be one of device, host, disk or none$"):
        kubectl.apply(bad_tier, env.namespace)
    bad_server = local_server_sample(env.adapters_dir)
    bad_server["metadata"]["name"] = "bad-scaling"
    bad_server["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 5, "maxReplicas": 2}
    with pytest.raises(KubectlError, match="autoscaling.minReplicas must not exceed autoscaling.maxReplicas"):
        kubectl.apply(bad_server, env.namespace)
    # GPU settings on a CPU server, and more than one GPU, are refused with the CRD's rules' lines
    cpu_tuned = local_server_sample(env.adapters_dir)
    cpu_tuned["metadata"]["name"] = "bad-gpu-settings"
    cpu_tuned["spec"]["engine"]["gpuMemoryUtilization"] = 0.9
    with pytest.raises(KubectlError, match=r"engine.gpuMemoryUtilization applies only to GPU servers \(resources"):
        kubectl.apply(cpu_tuned, env.namespace)
    two_gpus = local_server_sample(env.adapters_dir)
    two_gpus["metadata"]["name"] = "bad-gpus"
    two_gpus["spec"]["resources"] = {"gpus": 2}
    with pytest.raises(KubectlError, match="serves a model on one GPU: resources.gpus must be 0 or 1"):
        kubectl.apply(two_gpus, env.namespace)
    # baseModelServer is immutable
    moved = local_adapter_sample("french", env.adapters_dir)
    moved["spec"]["baseModelServer"] = "another"
    with pytest.raises(KubectlError, match="baseModelServer is immutable"):
        kubectl.apply(moved, env.namespace)
    assert "bad-source" not in kubectl("get", "lora", "-n", env.namespace, "-o", "name")


# b. the server pool


def test_b_server_deployment_service_and_ready_pods(env: Env) -> None:
    pods = wait_server_ready(env, 2)
    assert_single_children(env)
    deployment = env.get("deployment", SERVER)
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][1:] == ["-m", "loraplane_server.serving.cli", "serve"]
    assert "--adapter-source-allow" in container["args"] and "$(POD_IP)" in container["args"]
    assert container["args"][container["args"].index("--device") + 1] == "cpu"  # resources.gpus 0: no CUDA probe
    service = env.get("service", SERVER)
    assert service["spec"]["selector"][SERVER_LABEL] == SERVER
    assert service["spec"]["ports"][0]["port"] == 8080
    assert len({p["status"]["podIP"] for p in pods}) == 2
    for pod in pods:
        assert http_status(f"http://{pod['status']['podIP']}:8080/ready") == 200
    status = env.bms()["status"]
    assert status["selector"] and status["observedGeneration"] == env.bms()["metadata"]["generation"]
    assert sorted(status.get("endpoints", {})) == names(pods)
    printed = env.kubectl("get", "bms", SERVER, "-n", env.namespace)
    assert "Ready" in printed and "smollm2-135m" in printed
    pdb = env.get("poddisruptionbudget", SERVER)
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"][SERVER_LABEL] == SERVER
    assert pdb["status"].get("expectedPods") in (None, 2)  # the disruption controller may not have counted yet


def test_b2_admin_api_is_closed_without_a_token_ref(env: Env) -> None:
    """The sample names no adminTokenSecretRef: the operator made a Secret with a random token, owned by the
    server, and the pods hold it. Anonymous registration is refused on the admin route and through a generation
    request; the token from the Secret is accepted."""
    secret = env.get("secret", f"{SERVER}-admin-token")
    owners = secret["metadata"].get("ownerReferences") or []
    assert [(o["kind"], o["name"]) for o in owners] == [("BaseModelServer", SERVER)]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 40
    pod = ready_server_pods(env.kubectl, env.namespace, SERVER)[0]
    assert admin_headers(pod) == {"Authorization": f"Bearer {token}"}  # the pod's own environment
    body = {"id": "anonymous", "source": str(env.adapters_dir / "french")}
    with requests.Session() as session:
        session.trust_env = False
        url, admin = pod_url(pod), pod_url(pod, ADMIN_PORT)
        assert session.post(f"{admin}/v1/adapters", json=body, timeout=10).status_code == 401
        assert session.get(f"{admin}/v1/adapters", timeout=10).status_code == 401
        on_api_port = session.get(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert on_api_port.status_code == 404 and "admin port" in on_api_port.text  # not on the API's port
        french = str(env.adapters_dir / "french")  # an allowed source: only the missing token refuses it
        lorax = {"inputs": "Hi", "parameters": {"adapter_id": french, "adapter_source": "local", "max_new_tokens": 1}}
        assert session.post(f"{url}/generate", json=lorax, timeout=30).status_code in (401, 403)
        listed = session.get(f"{admin}/v1/adapters", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert listed.status_code == 200 and "anonymous" not in {row["id"] for row in listed.json()["data"]}
    applied = env.bms()
    assert env.get("secret", f"{SERVER}-admin-token")["data"] == secret["data"]  # reconciles keep the token
    assert applied["status"].get("observedGeneration") == applied["metadata"]["generation"]


def test_b2b_disruption_budget_turned_off_and_on_rolls_no_pod(env: Env) -> None:
    """spec.disruptionBudget off deletes the PodDisruptionBudget, on makes it again; neither is part of a pod,
    so the pods stay the same ones (no rollout for a switch that shapes no pod)."""
    before = names(ready_server_pods(env.kubectl, env.namespace, SERVER))
    template = env.get("deployment", SERVER)["spec"]["template"]

    def switch(enabled: bool) -> None:
        patch = json.dumps({"spec": {"disruptionBudget": {"enabled": enabled}}})
        env.kubectl("patch", "bms", SERVER, "-n", env.namespace, "--type=merge", "-p", patch)

    def budgets() -> list[str]:
        return env.kubectl("get", "pdb", "-n", env.namespace, "-o", "name").split()

    switch(False)
    wait_until(lambda: not budgets() or None, timeout=60, what="the PodDisruptionBudget deleted")
    switch(True)
    wait_until(lambda: budgets() == [f"poddisruptionbudget.policy/{SERVER}"], timeout=60, what="it made again")
    assert env.get("deployment", SERVER)["spec"]["template"] == template
    assert names(ready_server_pods(env.kubectl, env.namespace, SERVER)) == before


def test_b3_server_pods_pass_pod_security_restricted(env: Env) -> None:
    """The real PodSecurity admission plugin, enforcing `restricted` on a namespace, admits the pod the operator
    made and the default pod (read-only root, its /tmp and /cache volumes, a claim-backed model cache); it
    refuses the same pod without the securityContext, so the check can fail."""
    deployed = env.get("deployment", SERVER)["spec"]["template"]["spec"]
    assert pod_security_verdict(env.kubectl, deployed, "as-deployed") == ""
    default = builders.get_deployment(
        {"metadata": {"name": SERVER}, "spec": {"modelCache": {"volume": "PersistentVolumeClaim"}}}
    )["spec"]["template"]["spec"]
    assert pod_security_verdict(env.kubectl, default, "default") == ""
    bare = copy.deepcopy(deployed)
    bare.pop("securityContext")
    for container in bare["containers"]:
        container.pop("securityContext")
    refusal = pod_security_verdict(env.kubectl, bare, "bare")
    assert "violates PodSecurity" in refusal and "restricted" in refusal, refusal


# c. adapters prewarmed on every pod, and serving


def test_c_adapters_prewarmed_on_every_pod_and_serve(env: Env) -> None:
    # the broken adapter of scenario g goes in now (refused at once; g checks it stays so)
    broken = adapter_manifest(BROKEN, SERVER, str(env.adapters_dir / "does-not-exist"), tier="host")
    env.kubectl.apply(broken, env.namespace)

    pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
    wait_adapters_on(env, list(ADAPTER_NAMES), names(pods), timeout=180)
    for name in ADAPTER_NAMES:
        lora = env.lora(name)
        assert FINALIZER in lora["metadata"]["finalizers"]
        status = lora["status"]
        assert status["rank"] > 0 and status["sizeBytes"] > 0 and status["ready"] == "2/2"
        assert {e["pod"] for e in status["residency"]} == set(names(pods))
        for entry in status["residency"]:
            assert entry["since"]
    for pod in pods:
        rows = adapter_rows(pod)
        for name in ADAPTER_NAMES:
            assert rows[name]["state"] == "ready", rows[name]
            assert rows[name]["source"] == str(env.adapters_dir / name)
        assert rows["french"]["pinned"] is True  # the sample pins it

    # each pod answers each adapter's greedy request as transformers + PEFT do in this process, and each
    # adapter changes the base model's answer
    env.prompt_ids, env.outputs = reference_greedy({n: env.adapters_dir / n for n in ADAPTER_NAMES}, PROMPT, MAX_TOKENS)
    for name in ADAPTER_NAMES:
        assert env.outputs[name] != env.outputs[BASE], f"{name} answers like the base model: {env.outputs}"
    for pod in pods:
        for model in (BASE, *ADAPTER_NAMES):
            got = env.complete(pod, model)
            assert got == env.outputs[model], f"{model} on {pod['metadata']['name']}: {got!r} != {env.outputs[model]!r}"


# d. a server process dies; the kubelet restarts it; the operator prewarms it again


def test_d_restarted_server_is_prewarmed_again(env: Env) -> None:
    pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
    victim = pods[0]
    victim_name, old_pid, old_restarts = victim["metadata"]["name"], pid_of(victim), restart_count(victim)
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        pod = env.get("pod", victim_name)
        return pod if restart_count(pod) > old_restarts and is_ready(pod) else None

    pod = wait_until(restarted, timeout=POD_START_S, what=f"{victim_name} restarted and Ready")
    assert pid_of(pod) != old_pid
    # a fresh process knows nothing until the operator prewarms it
    wait_until(lambda: all(pod_holds(pod, n) for n in ADAPTER_NAMES), timeout=90, what=f"{victim_name} prewarmed")
    wait_server_ready(env, 2, timeout=60)
    wait_adapters_on(env, list(ADAPTER_NAMES), names(pods), timeout=90)
    for name in ADAPTER_NAMES:
        assert env.complete(pod, name) == env.outputs[name]


# e. the operator is killed mid-reconcile and restarted


def test_e_operator_killed_mid_reconcile_converges(env: Env) -> None:
    """SIGKILL while an adapter is being added and a rollout is starting; the operator stays down while a new
    server pod turns Ready (it misses that pod's Ready event), then restarts and must converge on its own."""
    pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
    extra = adapter_manifest("french-b", SERVER, str(env.adapters_dir / "french"), tier="host")
    env.kubectl.apply(extra, env.namespace)

    def operator_saw_new_adapter() -> bool:
        meta = env.lora("french-b")["metadata"]
        return FINALIZER in (meta.get("finalizers") or [])

    wait_until(operator_saw_new_adapter, timeout=60, what="the operator picked up french-b", interval=0.1)
    patch = json.dumps({"spec": {"env": [{"name": "LORAPLANE_E2E", "value": "1"}]}})
    env.kubectl("patch", "bms", SERVER, "-n", env.namespace, "--type=merge", "-p", patch)

    def template_applied() -> bool:
        containers = env.get("deployment", SERVER)["spec"]["template"]["spec"]["containers"]
        return any(e["name"] == "LORAPLANE_E2E" for e in containers[0].get("env") or [])

    wait_until(template_applied, timeout=60, what="the operator applied the new pod template", interval=0.1)
    env.operator.kill()  # mid-reconcile: french-b loading, the rollout just begun, kopf's bookkeeping in flight
    assert not env.operator.is_running

    def new_pod_ready() -> list[dict[str, Any]] | None:
        fresh = [
            p for p in ready_server_pods(env.kubectl, env.namespace, SERVER) if p["metadata"]["name"] not in names(pods)
        ]
        return fresh or None

    missed = wait_until(new_pod_ready, timeout=POD_START_S, what="a new server pod Ready while the operator is down")
    assert "french-b" not in adapter_rows(missed[0])  # nobody prewarmed it: the operator was down
    env.operator.start()
    env.operator.wait_started()

    def rolled_out() -> list[dict[str, Any]] | None:
        deployment = env.get("deployment", SERVER)
        status = deployment.get("status") or {}
        generation_seen = status.get("observedGeneration") == deployment["metadata"]["generation"]
        done = status.get("updatedReplicas") == 2 and status.get("replicas") == 2 and status.get("readyReplicas") == 2
        return ready_server_pods(env.kubectl, env.namespace, SERVER) if generation_seen and done else None

    wait_until(rolled_out, timeout=2 * POD_START_S, what="the Deployment rolled out with the new spec")
    new_pods = wait_server_ready(env, 2, timeout=120)
    assert set(names(new_pods)).isdisjoint(names(pods)), "the pods were not replaced"
    EXPECTED_TIER["french-b"] = "host"
    wait_adapters_on(env, [*ADAPTER_NAMES, "french-b"], names(new_pods), timeout=120)
    assert_single_children(env)
    assert_resident_once(new_pods, [*ADAPTER_NAMES, "french-b"])
    for name in [*ADAPTER_NAMES, "french-b"]:
        assert env.lora(name)["metadata"]["finalizers"].count(FINALIZER) == 1
    for pod in new_pods:
        assert env.complete(pod, "french-b") == env.outputs["french"]  # the same weights under another id
        assert env.complete(pod, "json") == env.outputs["json"]


# f. deleting an adapter unloads it everywhere


def test_f_deleted_adapter_is_unloaded_everywhere(env: Env) -> None:
    pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
    assert all("french-b" in adapter_rows(p) for p in pods)
    env.kubectl("delete", "lora", "french-b", "-n", env.namespace, "--wait=false")

    def gone() -> bool:
        try:
            env.lora("french-b")
        except KubectlError as error:
            return "NotFound" in str(error)
        return False

    wait_until(gone, timeout=60, what="LoRAAdapter french-b gone (finalizer removed)")
    for pod in pods:
        assert "french-b" not in adapter_rows(pod), f"french-b still on {pod['metadata']['name']}"
    EXPECTED_TIER.pop("french-b", None)
    # the others are untouched
    for pod in pods:
        assert all(pod_holds(pod, n) for n in ADAPTER_NAMES)


# g. a broken source fails that adapter only


def test_g_broken_source_fails_alone(env: Env) -> None:
    """A source missing on the pods is refused at registration (a 4xx): Failed at once with the reason, one
    attempt, never re-sent, and the other adapters untouched."""

    def failed() -> dict[str, Any] | None:
        lora = env.lora(BROKEN)
        return lora if (lora.get("status") or {}).get("phase") == "Failed" else None

    lora = wait_until(failed, timeout=60, what=f"LoRAAdapter {BROKEN} Failed", interval=1)
    status = lora["status"]
    assert "does not exist" in status["message"], status["message"]
    assert "loraplane.dev/retry" in status["message"]  # says how to retry
    assert status["attempts"] == 1 and status["readyReplicas"] == 0, status
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Failed"
    pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
    wait_adapters_on(env, list(ADAPTER_NAMES), names(pods), timeout=30)  # the others are untouched
    for pod in pods:
        assert BROKEN not in adapter_rows(pod)  # refused, so never registered
        assert env.complete(pod, "pirate") == env.outputs["pirate"]
    printed = env.kubectl("get", "lora", BROKEN, "-n", env.namespace)
    assert "Failed" in printed
    time.sleep(20)  # a few operator rounds later: still Failed, still one attempt
    assert env.lora(BROKEN)["status"]["attempts"] == 1 and env.lora(BROKEN)["status"]["phase"] == "Failed"


# h. scaling through the scale subresource


def test_h_scale_subresource_new_pod_gets_every_adapter(env: Env) -> None:
    before = names(ready_server_pods(env.kubectl, env.namespace, SERVER))
    env.kubectl("scale", "bms", SERVER, "-n", env.namespace, "--replicas=3")
    assert env.bms()["spec"]["replicas"] == 3
    pods = wait_server_ready(env, 3)
    new = [p for p in pods if p["metadata"]["name"] not in before]
    assert len(new) == 1
    assert env.get("deployment", SERVER)["spec"]["replicas"] == 3
    scale_path = f"/apis/loraplane.dev/v1alpha1/namespaces/{env.namespace}/basemodelservers/{SERVER}/scale"
    scale = json.loads(env.kubectl("get", "--raw", scale_path))
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == env.bms()["status"]["selector"]
    wait_until(lambda: all(pod_holds(new[0], n) for n in ADAPTER_NAMES), timeout=90, what="the new pod prewarmed")
    wait_adapters_on(env, list(ADAPTER_NAMES), names(pods), timeout=90)
    for name in ADAPTER_NAMES:
        assert env.lora(name)["status"]["ready"] == "3/3"
        assert env.complete(new[0], name) == env.outputs[name]
    assert_single_children(env)
