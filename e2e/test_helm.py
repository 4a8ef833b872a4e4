"""The Helm chart on the local control plane: `helm template` output accepted by the real API server
(server-side dry run, strict field validation); `helm install` with the operator pod run by the process
kubelet and a BaseModelServer and LoRAAdapters from values coming up Ready with residency; `helm upgrade`
of a server value rolling the server pods; `helm uninstall` leaving nothing but the CRDs, its pre-delete
hook letting the still-running operator unload the adapters and drop its finalizers first.
One release in one namespace for the module; the tests run in order (a: install ... d: uninstall)."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import LocalCluster
from e2e.helm import CHART, Helm, HelmError
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import (
    FINALIZER,
    adapter_manifest,
    adapter_rows,
    complete,
    diagnostics,
    is_ready,
    list_adapters,
    local_server_sample,
    pid_of,
    ready_server_pods,
    restart_count,
    snapshot_adapters,
)

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-helm"
DRY_NAMESPACE = "e2e-helm-dry-run"
RELEASE = "lp"
SERVER = "smollm2"
FULLNAME = f"{RELEASE}-loraplane"
# when each `helm uninstall` began: from then on the release's operator pods may outlive their RoleBinding (its
# pods stop after helm deleted the rules), so test_rbac_audit counts none of their refusals as a missing rule
UNINSTALLS: list[datetime] = []
OPERATOR = f"{FULLNAME}-operator"
ADAPTERS = {"french": "device", "json": "host"}  # name -> prewarm tier
POD_START_S = 240.0
CRDS = ("basemodelservers.loraplane.dev", "loraadapters.loraplane.dev")
CONFIG_HASH = "loraplane.dev/config-hash"
OPERATOR_REPLICAS = 2  # the chart's default: leader election over a Lease named like the Deployment
FAILOVER_S = 30.0  # issue 39: a killed leader's work resumes in the other replica within 30 s
RELEASE_LABEL = f"app.kubernetes.io/instance={RELEASE}"


def chart_values(adapters_dir: Path) -> dict[str, Any]:
    """Values for the process kubelet: the operator watches this namespace and binds its liveness endpoint
    to its own pod address (pods share this machine's network); a small CPU server; two example adapters."""
    engine = local_server_sample(adapters_dir)["spec"]["engine"]
    return {
        "operator": {"watchNamespace": NAMESPACE, "livenessBindAddress": "$(POD_IP)"},
        "server": {
            "enabled": True,
            "name": SERVER,
            "replicas": 1,
            "resources": {"gpus": 0},
            "engine": engine,
            "adapterSourceAllow": [str(adapters_dir)],
            "args": ["--disk-cache-dir", "adapter-disk-cache", "--torch-threads", "1"],
            "pod": {"readOnlyRootFilesystem": False},  # one shared file system: see local_server_sample
        },
        "adapters": [
            {"name": name, "source": str(adapters_dir / name), "prewarm": {"tier": tier}, "pinned": name == "french"}
            for name, tier in ADAPTERS.items()
        ],
    }


@dataclass
class Env:
    helm: Helm
    kubectl: Kubectl
    cluster: LocalCluster
    values: dict[str, Any]
    values_file: Path

    def get(self, *args: str) -> Any:
        return self.kubectl.json("get", *args, "-n", NAMESPACE)

    def write_values(self, values: dict[str, Any]) -> Path:
        self.values_file.write_text(yaml.safe_dump(values))
        return self.values_file


@pytest.fixture(scope="module")
def env(helm: Helm, kubectl: Kubectl, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = Path(tmp_path_factory.mktemp("helm"))
    values = chart_values(snapshot_adapters(work / "adapters"))
    environment = Env(helm, kubectl, cluster, values, work / "values.yaml")
    environment.write_values(values)
    try:
        yield environment
    finally:
        _teardown(environment)


def _teardown(env: Env) -> None:
    """If a test stopped before the uninstall: uninstall (hooks first), else drop finalizers by hand."""
    try:
        if RELEASE in env.helm("list", "-n", NAMESPACE, "-q").split():
            UNINSTALLS.append(datetime.now(UTC))
            env.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "3m")
    except HelmError:
        for kind in ("lora", "bms"):
            for item in env.get(kind)["items"]:
                patch = json.dumps({"metadata": {"finalizers": None}})
                try:
                    env.kubectl("patch", kind, item["metadata"]["name"], "-n", NAMESPACE, "--type=merge", "-p", patch)
                except KubectlError:
                    pass
        try:
            UNINSTALLS.append(datetime.now(UTC))
            env.helm("uninstall", RELEASE, "-n", NAMESPACE, "--no-hooks")
        except HelmError:
            pass
    finally:
        try:
            env.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        except KubectlError:
            pass


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, env: Env) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        text = diagnostics(env.kubectl, env.cluster, None, NAMESPACE)
        for pod in env.get("pods", "-l", "app.kubernetes.io/component in (operator,uninstall)")["items"]:
            name = pod["metadata"]["name"]
            for container in ("operator", "uninstall"):
                log = "\n".join(env.cluster.pod_log(NAMESPACE, name, container).splitlines()[-60:])
                text += f"\n--- pod {name} ({container}.log tail) ---\n{log}" if log else ""
        print(f"\n===== diagnostics after {request.node.name} =====\n{text}")


# helpers


def operator_pods(env: Env) -> list[dict[str, Any]]:
    pods = env.get("pods", "-l", f"{RELEASE_LABEL},app.kubernetes.io/component=operator")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def lease_holder(env: Env) -> str | None:
    """The pod holding the operator's Lease (its identity is `<pod>_<random>`: one per process)."""
    try:
        holder = str(env.get("lease", OPERATOR)["spec"].get("holderIdentity") or "")
    except KubectlError:
        return None
    return holder.rpartition("_")[0] or None


def operator_pod(env: Env) -> dict[str, Any] | None:
    """The leader, once both operator replicas are Ready: the pod named by the Lease's holder."""
    live = operator_pods(env)
    if len(live) != OPERATOR_REPLICAS or not all(is_ready(p) for p in live):
        return None
    holder = lease_holder(env)
    return next((p for p in live if p["metadata"]["name"] == holder), None)


def server_ready(env: Env, replicas: int, template_hash: str | None = None) -> list[dict[str, Any]] | None:
    """`replicas` Ready server pods and no others (with this config hash if given), the BaseModelServer Ready."""
    pods = ready_server_pods(env.kubectl, NAMESPACE, SERVER)
    everything = env.get("pods", "-l", f"loraplane.dev/server={SERVER}")["items"]
    if len(pods) != replicas or len(everything) != replicas:
        return None
    if template_hash and any(p["metadata"]["annotations"].get(CONFIG_HASH) != template_hash for p in pods):
        return None
    status = env.get("bms", SERVER).get("status") or {}
    return pods if (status.get("phase"), status.get("readyReplicas")) == ("Ready", replicas) else None


def adapters_ready_on(env: Env, pod_names: list[str]) -> dict[str, dict[str, Any]] | None:
    """Every chart adapter Ready with residency on exactly `pod_names` (at its tier or warmer)."""
    out = {}
    for name, tier in ADAPTERS.items():
        lora = env.get("lora", name)
        status = lora.get("status") or {}
        residency = status.get("residency") or []
        if status.get("phase") != "Ready" or sorted(e["pod"] for e in residency) != sorted(pod_names):
            return None
        if any(e.get("state") != "ready" or (tier == "device" and e.get("tier") != "device") for e in residency):
            return None
        out[name] = lora
    return out


def names(pods: list[dict[str, Any]]) -> list[str]:
    return sorted(p["metadata"]["name"] for p in pods)


def rendered(env: Env, release: str, namespace: str) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "-n", namespace, "--include-crds", "-f", str(env.values_file)]
    return [d for d in yaml.safe_load_all(env.helm(*args)) if d]


def dry_run(env: Env, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Server-side dry run with strict field validation: the objects as the API server would store them."""
    manifest = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    out = env.kubectl("apply", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-", input=manifest)
    answer = json.loads(out)
    return list(answer["items"]) if answer.get("kind") == "List" else [answer]


# a. install


def test_a_install_operator_pod_server_and_adapters_ready(env: Env) -> None:
    out = env.helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "-f", str(env.values_file))
    assert "STATUS: deployed" in out and f"BaseModelServer {SERVER} serves smollm2-135m" in out  # NOTES.txt
    for crd in CRDS:
        env.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")

    # the operator Deployment's pod, run by the process kubelet as `loraplane operator`, under its account
    pod = wait_until(lambda: operator_pod(env), timeout=120, what="the operator pod Ready")
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["loraplane", "operator"]
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    assert pod["status"]["containerStatuses"][0]["containerID"].startswith("process://")
    deployment = env.get("deployment", OPERATOR)
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate" and deployment["spec"]["replicas"] == 2
    standby = next(p for p in operator_pods(env) if p["metadata"]["name"] != pod["metadata"]["name"])
    assert "holds the Lease" not in env.cluster.pod_log(NAMESPACE, standby["metadata"]["name"], "operator")

    # the BaseModelServer and adapters from values: the server pod Ready, the adapters resident on it
    pods = wait_until(lambda: server_ready(env, 1), timeout=POD_START_S, what=f"{SERVER} 1/1 Ready")
    loras = wait_until(lambda: adapters_ready_on(env, names(pods)), timeout=180, what="the adapters Ready")
    for name, lora in loras.items():
        assert lora["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert FINALIZER in lora["metadata"]["finalizers"]
        (entry,) = lora["status"]["residency"]
        assert entry["since"] and entry["tier"] in (("device",) if ADAPTERS[name] == "device" else ("device", "host"))
    rows = adapter_rows(pods[0])
    assert rows["french"]["state"] == "ready" and rows["french"]["pinned"] is True
    assert complete(pods[0], "french", "Hello, my name is") != complete(pods[0], "smollm2-135m", "Hello, my name is")
    bms = env.get("bms", SERVER)
    assert FINALIZER in bms["metadata"]["finalizers"]
    assert env.get("deployment", SERVER)["metadata"]["ownerReferences"][0]["uid"] == bms["metadata"]["uid"]
    # the operator runs in a pod, so it names itself in the servers' NetworkPolicy: the admin port is its and the
    # router's (the API server validated the policy; the process kubelet's loopback network does not enforce it)
    policy = env.get("networkpolicy", SERVER)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == bms["metadata"]["uid"]
    api_rule, admin_rule = policy["spec"]["ingress"]
    assert api_rule["ports"] == [{"port": "http", "protocol": "TCP"}] and "from" not in api_rule
    assert admin_rule["ports"] == [{"port": "admin", "protocol": "TCP"}]
    operator_peer = admin_rule["from"][1]
    assert operator_peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    assert operator_peer["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # the operator's liveness endpoint answers on its pod address, and the kubelet's probe has not restarted it
    running = operator_pod(env)
    assert running is not None and running["status"]["containerStatuses"][0]["restartCount"] == 0


# a2. the leader killed under activity


def test_a2_the_leader_killed_under_activity_fails_over(env: Env) -> None:
    """SIGKILL the Lease holder right after a new LoRAAdapter is created: the standby holds the Lease within
    30 s and finishes the work (the adapter Ready on the server pod, once), the chart's adapters stay Ready, and
    the killed replica comes back as a follower."""
    leader = wait_until(lambda: operator_pod(env), timeout=60, what="a leader among the operator replicas")
    killed = leader["metadata"]["name"]
    standby = next(p["metadata"]["name"] for p in operator_pods(env) if p["metadata"]["name"] != killed)
    pods = ready_server_pods(env.kubectl, NAMESPACE, SERVER)
    source = str(Path(env.values["adapters"][0]["source"]).parent / "pirate")
    env.kubectl.apply(adapter_manifest("pirate", SERVER, source, tier="host"), NAMESPACE)
    os.kill(pid_of(leader), signal.SIGKILL)
    start = time.monotonic()
    wait_until(lambda: lease_holder(env) == standby, timeout=FAILOVER_S, what=f"{standby} holding the Lease")
    took = time.monotonic() - start
    print(f"failover: {standby} took the Lease {took:.1f} s after {killed} was killed")

    def pirate_ready() -> dict[str, Any] | None:
        status = env.get("lora", "pirate").get("status") or {}
        residency = status.get("residency") or []
        return status if status.get("phase") == "Ready" and [e["pod"] for e in residency] == names(pods) else None

    wait_until(pirate_ready, timeout=180, what="pirate Ready, reconciled by the new leader")
    ids = [row["id"] for row in list_adapters(pods[0])]
    assert ids.count("pirate") == 1, ids
    assert adapters_ready_on(env, names(pods)) is not None
    assert "holds the Lease" in env.cluster.pod_log(NAMESPACE, standby, "operator")

    def back_as_follower() -> bool:
        pod = next((p for p in operator_pods(env) if p["metadata"]["name"] == killed), None)
        return pod is not None and is_ready(pod) and restart_count(pod) >= 1

    wait_until(back_as_follower, timeout=120, what=f"{killed} restarted and Ready again")
    assert lease_holder(env) == standby  # the restarted replica waits: no flapping
    env.kubectl("delete", "lora", "pirate", "-n", NAMESPACE, "--wait=false")
    wait_until(lambda: not [i for i in env.get("lora")["items"] if i["metadata"]["name"] == "pirate"], timeout=60,
               what="pirate unloaded and gone")  # fmt: skip


# b. the rendered chart against the API server's schemas


def test_b_template_is_valid_for_the_api_server(env: Env) -> None:
    """Every object `helm template` renders (hooks and CRDs included; values with everything a cluster
    without the Prometheus Operator's CRDs can hold) passes a server-side dry run with strict validation."""
    values = copy.deepcopy(env.values)
    values["server"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 4}
    values["monitoring"] = {"prometheusAdapterRule": {"enabled": True}}
    env.write_values(values)
    env.kubectl("create", "namespace", DRY_NAMESPACE)
    try:
        docs = rendered(env, "dry", DRY_NAMESPACE)
        _check_dry_run(env, docs)
    finally:
        env.write_values(env.values)
        env.kubectl("delete", "namespace", DRY_NAMESPACE, "--wait=false")


def _check_dry_run(env: Env, docs: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in docs}
    expected = {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"}
    expected |= {"BaseModelServer", "LoRAAdapter", "ConfigMap", "Role", "RoleBinding", "Job"}
    assert kinds == expected, kinds
    accepted = dry_run(env, docs)
    assert sorted((a["kind"], a["metadata"]["name"]) for a in accepted) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in docs
    )
    # the API server filled in its defaults, so these are real validated objects, not echoes
    deployment = next(a for a in accepted if a["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"]
    bms = next(a for a in accepted if a["kind"] == "BaseModelServer")
    assert bms["spec"]["imagePullPolicy"] == "IfNotPresent" and bms["spec"]["autoscaling"]["kind"] == "hpa"

    # and the validator does reject: an unknown field, and a spec the CRD's rules refuse
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(KubectlError, match="unknown field"):
        dry_run(env, [broken])
    bad = copy.deepcopy(next(d for d in docs if d["kind"] == "BaseModelServer"))
    bad["spec"]["autoscaling"].update(minReplicas=5, maxReplicas=2)
    with pytest.raises(KubectlError, match="minReplicas must not exceed"):
        dry_run(env, [bad])
    eager_on_cpu = copy.deepcopy(next(d for d in docs if d["kind"] == "BaseModelServer"))
    eager_on_cpu["spec"]["engine"]["enforceEager"] = True  # the chart's server has resources.gpus 0
    with pytest.raises(KubectlError, match="engine.enforceEager applies only to GPU servers"):
        dry_run(env, [eager_on_cpu])
    stored = env.kubectl.json("get", "lora,bms,deploy,job,clusterrole", "-A", "-l", "app.kubernetes.io/instance=dry")
    assert not stored["items"], "a dry run stored objects"


# c. upgrade


def test_c_upgrade_changing_a_server_value_rolls_the_servers(env: Env) -> None:
    before = ready_server_pods(env.kubectl, NAMESPACE, SERVER)
    old_hash = env.get("deployment", SERVER)["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]
    operator_uid = operator_pod(env)["metadata"]["uid"]  # type: ignore[index]
    values = copy.deepcopy(env.values)
    values["server"]["engine"]["maxNumSeqs"] = 3
    env.write_values(values)
    env.values = values
    out = env.helm("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(env.values_file))
    assert "REVISION: 2" in out

    def new_template() -> str | None:
        annotations = env.get("deployment", SERVER)["spec"]["template"]["metadata"]["annotations"]
        return annotations[CONFIG_HASH] if annotations[CONFIG_HASH] != old_hash else None

    new_hash = wait_until(new_template, timeout=60, what="the operator applying the new pod template")
    pods = wait_until(lambda: server_ready(env, 1, new_hash), timeout=POD_START_S, what="the rolled server pod")
    assert set(names(pods)).isdisjoint(names(before)), "the server pods were not replaced"
    args = pods[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "3"
    wait_until(lambda: adapters_ready_on(env, names(pods)), timeout=180, what="the adapters prewarmed on the new pod")
    # the operator's own pod template did not change: it was not restarted
    assert operator_pod(env)["metadata"]["uid"] == operator_uid  # type: ignore[index]
    history = json.loads(env.helm("history", RELEASE, "-n", NAMESPACE, "-o", "json"))
    assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"


# d. uninstall


def test_d_uninstall_leaves_only_the_crds(env: Env) -> None:
    operator_name = operator_pod(env)["metadata"]["name"]  # type: ignore[index]
    assert all(FINALIZER in env.get("lora", n)["metadata"]["finalizers"] for n in ADAPTERS)
    UNINSTALLS.append(datetime.now(UTC))
    env.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "3m")

    # the hook deleted the adapters first, while the operator ran: its unload handler succeeded for each
    operator_log = env.cluster.pod_log(NAMESPACE, operator_name, "operator")
    assert operator_log.count("Handler 'unload_adapter' succeeded") >= len(ADAPTERS), operator_log[-3000:]
    assert env.cluster.kubelet_root is not None
    hook_pods = (env.cluster.kubelet_root / "pods").glob(f"{NAMESPACE}_{FULLNAME}-uninstall-*")
    hook_logs = [env.cluster.pod_log(NAMESPACE, path.name.split("_")[1], "uninstall") for path in hook_pods]
    done = [log for log in hook_logs if "basemodelservers gone" in log]
    assert len(done) == 1, hook_logs
    # the servers (whose deletion stops their pods) go only after the adapters were unloaded and gone
    assert done[0].index("loraadapters gone") < done[0].index("deleting 1 basemodelservers"), done[0]

    def left_in_namespace() -> list[str]:
        kinds = "all,sa,cm,secret,role,rolebinding,job,hpa,lora,bms,endpoints,endpointslices,networkpolicy,pdb"
        return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in env.get(kinds)["items"])

    # what every namespace has; the pods (operator, server, hook) go last, after their grace periods
    defaults = ["ConfigMap/kube-root-ca.crt", "ServiceAccount/default"]
    wait_until(lambda: left_in_namespace() == defaults, timeout=120, what="only the defaults left", interval=1)
    for kind in ("clusterroles", "clusterrolebindings"):
        assert not env.kubectl.json("get", kind, "-l", RELEASE_LABEL)["items"], kind
    assert RELEASE not in env.helm("list", "-A", "-q").split()
    # Helm keeps CRDs (and so every user's custom resources elsewhere) on uninstall
    crds = env.kubectl.json("get", "crd", "-l", "app.kubernetes.io/part-of=loraplane")["items"]
    assert sorted(c["metadata"]["name"] for c in crds) == sorted(CRDS)
