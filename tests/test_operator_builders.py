"""The operator's pure manifest builders: Deployment (with the model cache volume and the credentials' env),
the cache's claim, Service, HPA, ScaledObject, config hash, RBAC data."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from loraplane_operator import builders, network_builders, rbac, router_builders, vllm_builders
from loraplane_operator import constants as c
from loraplane_operator.server_status import PodInfo, pod_info, server_ref

ROOT = Path(__file__).resolve().parents[1]


def bms(**spec) -> dict:
    return {"metadata": {"name": "smollm2", "namespace": "ml", "generation": 3}, "spec": spec}


def sample() -> dict:
    obj = yaml.safe_load((ROOT / "crds" / "samples" / "loraplane.dev_v1alpha1_basemodelserver.yaml").read_text())
    obj["metadata"]["namespace"] = "ml"
    return obj


def container(dep: dict) -> dict:
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    return ctr


def test_deployment_defaults():
    dep = builders.get_deployment(bms())
    assert dep["apiVersion"] == "apps/v1" and dep["kind"] == "Deployment"
    assert dep["metadata"]["name"] == "smollm2" and dep["metadata"]["namespace"] == "ml"
    assert "ownerReferences" not in dep["metadata"]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"]["matchLabels"] == {c.NAME_LABEL: c.APP_NAME, c.SERVER_LABEL: "smollm2"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= dep["spec"]["selector"]["matchLabels"].items()
    assert labels[c.MANAGED_BY_LABEL] == c.MANAGED_BY
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    ctr = container(dep)
    assert ctr["command"] == ["loraplane", "serve"]
    assert ctr["args"] == [
        *("--model", "smollm2-135m", "--device", "cuda", "--host", "$(POD_IP)", "--port", "8080"),
        *("--admin-port", "8081"),  # the admin routes apart, where the NetworkPolicy lets few in
        *("--prewarm-timeout", "120"),  # no cold pod in rotation: Ready once prewarmed, 120 s at most
    ]
    assert ctr["env"] == [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "LORAPLANE_ADMIN_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "smollm2-admin-token", "key": "token"}},
        },
    ]  # no adminTokenSecretRef: the operator's generated token, never an open admin API
    assert ctr["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "admin", "containerPort": 8081, "protocol": "TCP"},
    ]
    assert ctr["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert ctr["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert ctr["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the failure line reaches the status
    # no modelCache: only the read-only root's two writable emptyDirs
    assert ctr["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/cache"}]
    assert pod_spec(dep)["volumes"] == [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]


def test_deployment_from_the_sample():
    dep = builders.get_deployment(sample())
    ctr = container(dep)
    args = ctr["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--max-loras"] == "8" and pairs["--max-lora-rank"] == "64"
    assert pairs["--max-num-seqs"] == "64" and pairs["--max-num-batched-tokens"] == "2048"
    assert pairs["--host-cache-bytes"] == "2GiB" and pairs["--disk-cache-bytes"] == "20GiB"
    assert pairs["--dtype"] == "auto" and pairs["--max-queue"] == "256"
    allowed = [args[i + 1] for i, a in enumerate(args) if a == "--adapter-source-allow"]
    assert allowed == ["/opt/loraplane/adapters", "hf://"]
    assert dep["spec"]["replicas"] == 2
    assert ctr["image"] == "loraplane:latest"
    assert ctr["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 1},
    }


def test_deployment_with_everything():
    spec = {
        "model": "/models/llama",
        "command": ["python", "-m", "loraplane_server.serving.cli", "serve"],
        "args": ["--log-level", "debug"],
        "port": 9000,
        "resources": {"gpus": 0, "limits": {"cpu": 4}},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "adminTokenSecretRef": {"name": "admin", "key": "tok"},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "serviceAccountName": "reader",
        "engine": {
            "quantization": "int8",
            "dtype": "bfloat16",
            "speculative": "draft",
            "draftModel": "hf://HuggingFaceTB/SmolLM2-135M",
        },
    }
    dep = builders.get_deployment(bms(**spec))
    pod = dep["spec"]["template"]["spec"]
    ctr = container(dep)
    assert ctr["command"] == ["python", "-m", "loraplane_server.serving.cli", "serve"]
    assert ctr["args"][:8] == ["--model", "/models/llama", "--device", "cpu", "--host", "$(POD_IP)", "--port", "9000"]
    assert ctr["args"][-2:] == ["--log-level", "debug"]
    pairs = dict(zip(ctr["args"][:-2:2], ctr["args"][1:-2:2], strict=True))
    assert pairs["--quantization"] == "int8" and pairs["--dtype"] == "bfloat16" and pairs["--speculative"] == "draft"
    assert pairs["--draft-model"] == "hf://HuggingFaceTB/SmolLM2-135M"
    assert ctr["resources"] == {"limits": {"cpu": 4}}  # no GPU limit for gpus: 0
    assert {"name": "LORAPLANE_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "tok"}}} in ctr[
        "env"
    ]
    assert ctr["env"][0]["name"] == "POD_IP" and ctr["env"][-1] == {"name": "HF_HUB_OFFLINE", "value": "1"}
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["serviceAccountName"] == "reader"
    assert pod["terminationGracePeriodSeconds"] > 30


@pytest.mark.parametrize(
    ("resources", "device"),
    [
        (None, "cuda"),  # resources left out: gpus defaults to 1
        ({}, "cuda"),
        ({"requests": {"cpu": "2"}}, "cuda"),
        ({"gpus": 1}, "cuda"),
        ({"gpus": 0}, "cpu"),
        ({"gpus": 0, "limits": {"cpu": 4}}, "cpu"),
    ],
)
def test_device_follows_the_requested_gpus(resources, device):
    """A GPU pod is told --device cuda (it fails at start without a usable GPU, never loading the model on the
    node's CPU); a CPU pod --device cpu (it never probes for CUDA). Right after the model flags, before the
    user's args."""
    spec = {"model": "s3://models/x", "modelCache": {}, "args": ["--device", "cuda:1"]}
    if resources is not None:
        spec["resources"] = resources
    args = container(builders.get_deployment(bms(**spec)))["args"]
    assert args[:6] == ["--model", "s3://models/x", "--model-cache", builders.DEFAULT_CACHE_MOUNT, "--device", device]
    assert args.count("--device") == 2 and args[-2:] == ["--device", "cuda:1"]  # the user's own args come last


def test_gpu_engine_fields_become_flags():
    engine = {"gpuMemoryUtilization": 0.85, "enforceEager": True, "maxLoras": 4}
    args = container(builders.get_deployment(bms(engine=engine)))["args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.85"
    assert args.count("--enforce-eager") == 1
    assert "True" not in args and "true" not in args  # a store_true flag takes no value
    off = container(builders.get_deployment(bms(engine={"enforceEager": False, "gpuMemoryUtilization": 1})))["args"]
    assert "--enforce-eager" not in off and "False" not in off
    assert off[off.index("--gpu-memory-utilization") + 1] == "1"
    assert builders.engine_args({}) == []
    # a changed GPU setting rolls the pods
    assert builders.config_hash({"engine": {"enforceEager": True}}) != builders.config_hash({"engine": {}})


def test_the_draft_model_shares_the_model_cache_and_credentials():
    """The server resolves --draft-model as it does --model: the same --model-cache mount and credentials env."""
    spec = {
        "model": "hf://HuggingFaceTB/SmolLM2-360M",
        "modelCache": {"volume": "PersistentVolumeClaim"},
        "credentials": {"huggingFace": {"secretName": "hf"}},
        "engine": {"draftModel": "hf://HuggingFaceTB/SmolLM2-135M"},  # no speculative: requests opt in
    }
    ctr = container(builders.get_deployment(bms(**spec)))
    args = ctr["args"]
    assert args[args.index("--draft-model") + 1] == "hf://HuggingFaceTB/SmolLM2-135M"
    assert args[args.index("--model-cache") + 1] == builders.DEFAULT_CACHE_MOUNT
    assert "--speculative" not in args
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} in ctr["env"]
    assert any(m["mountPath"] == builders.DEFAULT_CACHE_MOUNT for m in ctr["volumeMounts"])
    other = builders.config_hash({**spec, "engine": {"draftModel": "/models/other-draft"}})
    assert builders.config_hash(spec) != other  # a new draft model rolls the pods


def test_deployment_keeps_the_autoscalers_replicas():
    auto = {"enabled": True, "minReplicas": 2, "maxReplicas": 4}
    assert builders.get_deployment(bms(replicas=3, autoscaling=auto))["spec"]["replicas"] == 3  # first apply
    assert builders.get_deployment(bms(replicas=3, autoscaling=auto), 4)["spec"]["replicas"] == 4  # HPA's choice
    assert builders.get_deployment(bms(replicas=1, autoscaling=auto), 9)["spec"]["replicas"] == 4  # clamped
    assert builders.get_deployment(bms(replicas=1, autoscaling=auto), 0)["spec"]["replicas"] == 2
    off = {**auto, "enabled": False}
    assert builders.get_deployment(bms(replicas=3, autoscaling=off), 4)["spec"]["replicas"] == 3


def test_config_hash_tracks_the_pod_shaping_spec_only():
    base = sample()["spec"]
    h = builders.config_hash(base)
    assert h == builders.config_hash(copy.deepcopy(base))
    assert h == builders.config_hash(dict(reversed(list(base.items()))))  # key order does not matter
    scaled = {**copy.deepcopy(base), "replicas": 7, "autoscaling": {"enabled": True, "maxReplicas": 9}}
    assert builders.config_hash(scaled) == h
    changed = copy.deepcopy(base)
    changed["engine"]["maxLoras"] = 16
    assert builders.config_hash(changed) != h
    assert builders.config_hash({**base, "image": "loraplane:v2"}) != h
    assert builders.config_hash({**base, "adminTokenSecretRef": {"name": "other"}}) != h
    unshaped = {**base, "networkPolicy": {"enabled": False}, "disruptionBudget": {"maxUnavailable": 2}}
    assert builders.config_hash(unshaped) == h  # neither is part of a pod: switching them rolls none
    dep = builders.get_deployment(sample())
    assert dep["spec"]["template"]["metadata"]["annotations"] == {c.CONFIG_HASH_ANNOTATION: h}


def test_service():
    svc = builders.get_service(bms(port=9000))
    assert (svc["apiVersion"], svc["kind"]) == ("v1", "Service")
    assert svc["metadata"]["name"] == "smollm2" and svc["metadata"]["namespace"] == "ml"
    assert svc["spec"]["selector"] == builders.get_deployment(bms())["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["type"] == "ClusterIP"


def test_hpa():
    auto = {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 4}
    auto["scaleDownStabilizationSeconds"] = 120
    hpa = builders.get_autoscaler(bms(autoscaling=auto))
    assert hpa == builders.get_hpa(bms(autoscaling=auto))
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "smollm2"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "loraplane_queue_depth"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }
    ]
    assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 120}}


def test_scaled_object():
    auto = {"enabled": True, "kind": "keda", "minReplicas": 1, "maxReplicas": 5, "targetQueueDepth": 10}
    so = builders.get_autoscaler(bms(autoscaling=auto))
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "smollm2"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (1, 5, 30)
    (trigger,) = spec["triggers"]  # above zero: the queue alone
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue" and trigger["name"] == "queue"
    assert trigger["metadata"]["threshold"] == "10" and trigger["metadata"]["activationThreshold"] == "0"
    assert trigger["metadata"]["query"] == 'sum(loraplane_queue_depth{namespace="ml",pod=~"smollm2-.*"})'
    assert trigger["metadata"]["serverAddress"].startswith("http://")
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300 and "cooldownPeriod" not in spec
    custom = builders.get_scaled_object(bms(autoscaling={**auto, "query": "sum(x)", "prometheusAddress": "http://p"}))
    assert (
        custom["spec"]["triggers"][0]["metadata"] | {"query": "sum(x)", "serverAddress": "http://p"}
        == custom["spec"]["triggers"][0]["metadata"]
    )


def test_a_scaled_object_at_zero_wakes_on_held_requests_and_stays_up_while_any_runs():
    auto = {"enabled": True, "kind": "keda", "minReplicas": 0, "maxReplicas": 3, "targetQueueDepth": 4}
    auto |= {"scaleDownStabilizationSeconds": 90, "pollingIntervalSeconds": 5, "prometheusAddress": "http://p:9090"}
    spec = builders.get_scaled_object(bms(autoscaling=auto, engine={"maxNumSeqs": 16}, router={"enabled": True}))[
        "spec"
    ]
    assert (spec["minReplicaCount"], spec["pollingInterval"], spec["cooldownPeriod"]) == (0, 5, 90)
    triggers = {t["name"]: t["metadata"] for t in spec["triggers"]}
    assert list(triggers) == ["queue", "held", "running"]
    assert triggers["held"]["query"] == 'sum(loraplane_router_held_requests{namespace="ml",pod=~"smollm2-router-.*"})'
    assert triggers["held"]["threshold"] == "4"  # held requests count as queued ones
    assert triggers["running"]["query"] == 'sum(loraplane_requests_running{namespace="ml",pod=~"smollm2-.*"})'
    assert triggers["running"]["threshold"] == "16"  # a pod's worth of running requests: never more pods than needed
    assert {t["activationThreshold"] for t in triggers.values()} == {"0"}
    from loraplane_server.config import EngineConfig  # the operator's copy of the server's default (no torch there)

    assert c.DEFAULT_MAX_NUM_SEQS == EngineConfig.__dataclass_fields__["max_num_seqs"].default
    assert {t["serverAddress"] for t in triggers.values()} == {"http://p:9090"}
    vllm = bms(autoscaling=auto, engine={"kind": "vllm"}, router={"enabled": True})
    running = builders.get_scaled_object(vllm)["spec"]["triggers"][2]["metadata"]
    assert running["query"].startswith("sum(vllm:num_requests_running{") and running["threshold"] == "64"


def test_no_autoscaler_unless_enabled():
    assert builders.get_autoscaler(bms()) is None
    assert builders.get_autoscaler(bms(autoscaling={"enabled": False, "kind": "keda"})) is None


def test_selector_string_and_urls():
    assert builders.selector_string("s") == f"{c.NAME_LABEL}=loraplane-server,{c.SERVER_LABEL}=s"
    assert builders.pod_url("10.0.0.7", 8080) == "http://10.0.0.7:8080"
    assert builders.pod_url("fd00::7", 8080) == "http://[fd00::7]:8080"


def test_builders_do_not_mutate_their_input():
    obj = sample()
    before = copy.deepcopy(obj)
    builders.get_deployment(obj)
    builders.get_service(obj)
    builders.get_hpa(obj)
    builders.get_scaled_object(obj)
    assert obj == before


def test_rbac_rules_yaml_matches_the_constant():
    path = ROOT / "operator" / "loraplane_operator" / "rbac_rules.yaml"
    assert path.read_text() == rbac.render_yaml() and rbac.main(["--check"]) == 0  # generated from RULES
    expanded = {
        (g, r, v) for rule in rbac.RULES for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert set(rbac.NOT_EXERCISED) <= expanded and all(rbac.NOT_EXERCISED.values())  # each a right, with a reason
    assert yaml.safe_load(path.read_text()) == rbac.RULES
    role = rbac.cluster_role()
    assert role["kind"] == "ClusterRole" and role["rules"] == rbac.RULES
    granted = {(g, r) for rule in rbac.RULES for g in rule["apiGroups"] for r in rule["resources"]}
    for need in [
        ("", "persistentvolumeclaims"),
        ("loraplane.dev", "loraadapters/status"),
        ("loraplane.dev", "basemodelservers/finalizers"),
        ("apps", "deployments"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("keda.sh", "scaledobjects"),
        ("", "pods"),
        ("", "secrets"),
        ("", "events"),
    ]:
        assert need in granted
    secrets = next(r for r in rbac.RULES if r["resources"] == ["secrets"])
    assert secrets["verbs"] == ["get", "create"]  # never list, update or delete: a token made once, read by name
    claims = next(r for r in rbac.RULES if r["resources"] == ["persistentvolumeclaims"])
    assert claims["verbs"] == ["get", "create", "patch"]  # the model cache is never deleted by the operator
    puts = {r for rule in rbac.RULES if "update" in rule["verbs"] for r in rule["resources"]}
    assert puts == {"basemodelservers/finalizers", "loraadapters/finalizers"}  # it applies and patches, never PUTs


# model source, model cache, credentials
def pod_spec(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        ({}, {"emptyDir": {}}),
        ({"volume": "EmptyDir", "size": "40Gi"}, {"emptyDir": {"sizeLimit": "40Gi"}}),
        ({"volume": "PersistentVolumeClaim"}, {"persistentVolumeClaim": {"claimName": "smollm2-model-cache"}}),
        (
            {"volume": "PersistentVolumeClaim", "claimName": "shared-models"},
            {"persistentVolumeClaim": {"claimName": "shared-models"}},
        ),
        (
            {"volume": "HostPath", "hostPath": "/var/lib/models"},
            {"hostPath": {"path": "/var/lib/models", "type": "DirectoryOrCreate"}},
        ),
    ],
)
def test_model_cache_volume_kinds(cache, volume):
    dep = builders.get_deployment(bms(model="s3://models/smollm2", modelCache=cache))
    assert pod_spec(dep)["volumes"][0] == {"name": "model-cache", **volume}
    ctr = container(dep)
    assert ctr["volumeMounts"][0] == {"name": "model-cache", "mountPath": "/var/cache/loraplane-models"}
    assert ctr["args"][:4] == ["--model", "s3://models/smollm2", "--model-cache", "/var/cache/loraplane-models"]


def test_model_cache_mount_path_is_the_server_flag():
    cache = {"volume": "HostPath", "hostPath": "/data", "mountPath": "/models-cache"}
    ctr = container(builders.get_deployment(bms(modelCache=cache)))
    assert ctr["volumeMounts"][0]["mountPath"] == "/models-cache"
    assert ctr["args"][ctr["args"].index("--model-cache") + 1] == "/models-cache"


def restricted_violations(pod: dict) -> list[str]:
    """What Pod Security's `restricted` level (v1.30) refuses in a pod spec, as far as these pods can go wrong;
    the e2e asks the real admission plugin the same question."""
    bad = []
    sec = pod.get("securityContext") or {}
    if (sec.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        bad.append("seccompProfile")
    for ctr in pod["containers"] + pod.get("initContainers", []):
        csec = ctr.get("securityContext") or {}
        if csec.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{ctr['name']}: allowPrivilegeEscalation")
        if (csec.get("capabilities") or {}).get("drop") != ["ALL"]:
            bad.append(f"{ctr['name']}: capabilities")
        if not (csec.get("runAsNonRoot") or sec.get("runAsNonRoot")):
            bad.append(f"{ctr['name']}: runAsNonRoot")
        if csec.get("privileged") or csec.get("runAsUser") == 0 or sec.get("runAsUser") == 0:
            bad.append(f"{ctr['name']}: root")
    allowed = {"name", "emptyDir", "persistentVolumeClaim", "configMap", "secret", "projected", "downwardAPI",
               "csi", "ephemeral"}  # fmt: skip
    bad += [f"volume {v['name']}" for v in pod.get("volumes", []) if set(v) - allowed]
    return bad


def test_server_and_router_pods_meet_pod_security_restricted():
    body = bms(modelCache={"volume": "PersistentVolumeClaim"}, router={"enabled": True})
    assert restricted_violations(pod_spec(builders.get_deployment(body))) == []
    router = next(o for o in router_builders.get_router_objects(body) if o["kind"] == "Deployment")
    assert restricted_violations(router["spec"]["template"]["spec"]) == []
    assert router["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # the check itself refuses what restricted refuses: a hostPath cache, a root user
    hostpath = pod_spec(builders.get_deployment(bms(modelCache={"volume": "HostPath", "hostPath": "/models"})))
    assert restricted_violations(hostpath) == ["volume model-cache"]
    root = pod_spec(builders.get_deployment(bms()))
    root["securityContext"]["runAsUser"] = 0
    assert restricted_violations(root) == ["server: root"]


def test_read_only_root_writes_only_to_its_volumes():
    ctr = container(builders.get_deployment(bms()))
    assert ctr["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
    }  # fmt: skip
    assert {m["mountPath"] for m in ctr["volumeMounts"]} == {"/tmp", "/cache"}  # Dockerfile.server's writable dirs
    # a model cache mounted on /cache itself replaces the emptyDir there
    dep = builders.get_deployment(bms(modelCache={"volume": "EmptyDir", "mountPath": "/cache"}))
    assert [m["mountPath"] for m in container(dep)["volumeMounts"]] == ["/cache", "/tmp"]
    assert [v["name"] for v in pod_spec(dep)["volumes"]] == ["model-cache", "tmp"]
    # turned off for an image that writes elsewhere: no extra volumes, still non-root
    dep = builders.get_deployment(bms(pod={"readOnlyRootFilesystem": False}))
    assert container(dep)["securityContext"]["readOnlyRootFilesystem"] is False
    assert "volumes" not in pod_spec(dep) and "volumeMounts" not in container(dep)
    assert pod_spec(dep)["securityContext"]["runAsNonRoot"] is True


def test_spec_pod_scheduling_reaches_server_and_router_pods():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}  # fmt: skip
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"app": "x"}}}]  # fmt: skip
    pod = {
        "affinity": affinity,
        "topologySpreadConstraints": spread,
        "priorityClassName": "inference",
        "imagePullSecrets": [{"name": "registry"}],
        "nodeSelector": {"pool": "gpu", "zone": "b"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
    }
    body = bms(pod=pod, nodeSelector={"zone": "a", "arch": "amd64"}, tolerations=[{"key": "old", "operator": "Exists"}],
               serviceAccountName="reader", router={"enabled": True})  # fmt: skip
    server = pod_spec(builders.get_deployment(body))
    assert server["affinity"] == affinity and server["topologySpreadConstraints"] == spread
    assert server["priorityClassName"] == "inference" and server["imagePullSecrets"] == [{"name": "registry"}]
    assert server["nodeSelector"] == {"zone": "b", "arch": "amd64", "pool": "gpu"}  # spec.pod's wins
    assert [t["key"] for t in server["tolerations"]] == ["old", "gpu"]
    assert server["serviceAccountName"] == "reader"
    server["affinity"]["nodeAffinity"] = None
    assert pod["affinity"]["nodeAffinity"] is not None  # a copy: the body is never changed through the manifest
    router = next(o for o in router_builders.get_router_objects(body) if o["kind"] == "Deployment")
    rpod = router["spec"]["template"]["spec"]
    assert rpod["priorityClassName"] == "inference" and rpod["imagePullSecrets"] == [{"name": "registry"}]
    assert not {"affinity", "nodeSelector", "tolerations", "topologySpreadConstraints"} & set(rpod)  # off GPU nodes
    assert rpod["serviceAccountName"] == "smollm2-router"  # its own account
    vllm = pod_spec(vllm_builders.get_workload(bms(pod=pod, engine={"kind": "vllm"})))
    assert vllm["priorityClassName"] == "inference"


def test_admin_token_is_generated_unless_named():
    first, second = builders.get_admin_token_secret(bms()), builders.get_admin_token_secret(bms())
    assert first is not None and second is not None
    assert first["metadata"]["name"] == "smollm2-admin-token" and first["type"] == "Opaque" and "spec" not in first
    assert first["stringData"]["token"] != second["stringData"]["token"]  # random: never derived from the spec
    assert builders.admin_token_ref("smollm2", {}) == ("smollm2-admin-token", "token")
    named = {"adminTokenSecretRef": {"name": "mine", "key": "k"}}
    assert builders.admin_token_ref("smollm2", named) == ("mine", "k")
    assert builders.get_admin_token_secret(bms(**named)) is None
    vllm = {"engine": {"kind": "vllm"}}  # vLLM's key guards inference too: the user's choice
    assert builders.admin_token_ref("smollm2", vllm) is None and builders.get_admin_token_secret(bms(**vllm)) is None
    # the servers, the router and the operator's own calls all use the same Secret
    server_env = {e["name"]: e for e in container(builders.get_deployment(bms()))["env"]}
    router = next(
        o for o in router_builders.get_router_objects(bms(router={"enabled": True})) if o["kind"] == "Deployment"
    )
    router_env = {e["name"]: e for e in router["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = {"name": "smollm2-admin-token", "key": "token"}
    assert (
        server_env[c.ADMIN_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        == router_env[c.ADMIN_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        == ref
    )
    status_ref = server_ref(bms())
    assert (status_ref.token_secret, status_ref.token_key) == ("smollm2-admin-token", "token")


def test_disruption_budget():
    pdb = builders.get_disruption_budget(bms())
    assert pdb is not None and (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {c.NAME_LABEL: c.APP_NAME, c.SERVER_LABEL: "smollm2"}},
    }
    half = builders.get_disruption_budget(bms(disruptionBudget={"maxUnavailable": "50%"}))
    assert half is not None and half["spec"]["maxUnavailable"] == "50%"
    assert builders.get_disruption_budget(bms(disruptionBudget={"enabled": False})) is None


def test_prewarm_gate_becomes_the_servers_timeout_and_vllm_has_none():
    def args(**spec) -> list[str]:
        return container(builders.get_deployment(bms(**spec)))["args"]

    def timeout(flags: list[str]) -> str | None:
        return flags[flags.index("--prewarm-timeout") + 1] if "--prewarm-timeout" in flags else None

    assert timeout(args()) == str(c.PREWARM_TIMEOUT_S)
    assert timeout(args(prewarmGate={"timeoutSeconds": 600})) == "600"
    assert timeout(args(prewarmGate={"enabled": False, "timeoutSeconds": 600})) is None
    assert server_ref(bms()).is_gated and not server_ref(bms(prewarmGate={"enabled": False})).is_gated
    vllm = bms(engine={"kind": "vllm"}, resources={"gpus": 1})
    assert not server_ref(vllm).is_gated and builders.prewarm_timeout_s(vllm["spec"]) == 0
    assert "--prewarm-timeout" not in str(vllm_builders.get_workload(vllm, None))


def pod_of(workload: dict) -> PodInfo:
    """The PodInfo of a pod made from a Deployment's template, at 10.0.0.9."""
    template = workload["spec"]["template"]
    meta = {**template["metadata"], "name": "p", "namespace": "ml", "uid": "u"}
    info = pod_info({"metadata": meta, "spec": template["spec"], "status": {"podIP": "10.0.0.9"}})
    assert info is not None
    return info


def test_network_policy_opens_the_admin_port_to_the_router_and_the_operator_only():
    peer = network_builders.Peer("loraplane-system", {"app.kubernetes.io/name": "loraplane", "x": "y"})
    policy = network_builders.get_network_policy(bms(adminPort=9090), peer)
    assert policy is not None and (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert policy["metadata"]["name"] == "smollm2" and policy["metadata"]["namespace"] == "ml"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": builders.selector_labels("smollm2")} and spec["policyTypes"] == [
        "Ingress"
    ]
    api, admin = spec["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}]}  # clients, probes and Prometheus: from anywhere
    assert admin["ports"] == [{"port": "admin", "protocol": "TCP"}]
    router, operator = admin["from"]
    assert router == {"podSelector": {"matchLabels": router_builders.router_selector_labels("smollm2")}}
    assert operator == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "loraplane", "x": "y"}},
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "loraplane-system"}},
    }
    dep = builders.get_deployment(bms(adminPort=9090))
    assert {"name": "admin", "containerPort": 9090, "protocol": "TCP"} in container(dep)["ports"]
    assert "9090" in container(dep)["args"] and pod_of(dep).admin_url(8080) == "http://10.0.0.9:9090"
    assert network_builders.get_network_policy(bms(networkPolicy={"enabled": False}), peer) is None
    assert network_builders.get_network_policy(bms(), None) is None  # an operator outside the cluster
    vllm = bms(engine={"kind": "vllm"}, resources={"gpus": 1})
    assert network_builders.get_network_policy(vllm, peer) is None
    assert pod_of(vllm_builders.get_workload(vllm, None)).admin_url(8080) == "http://10.0.0.9:8080"  # its API port
    before = copy.deepcopy(builders.get_deployment(bms()))  # a pod made before the admin port existed
    container(before)["ports"] = [p for p in container(before)["ports"] if p["name"] != "admin"]
    assert pod_of(before).admin_url(8080) == "http://10.0.0.9:8080"  # still reached where it listens
    assert network_builders.parse_labels(" a=b, c=d ,") == {"a": "b", "c": "d"}
    with pytest.raises(ValueError, match="key=value"):
        network_builders.parse_labels("a=b,oops")


def test_created_claim():
    cache = {
        "volume": "PersistentVolumeClaim",
        "size": "40Gi",
        "storageClassName": "fast",
        "accessModes": ["ReadWriteOnce"],
    }
    claim = builders.get_model_cache_claim(bms(modelCache=cache))
    assert (claim["apiVersion"], claim["kind"]) == ("v1", "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "smollm2-model-cache" and claim["metadata"]["namespace"] == "ml"
    assert claim["metadata"]["labels"][c.SERVER_LABEL] == "smollm2" and "ownerReferences" not in claim["metadata"]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "40Gi"}},
        "storageClassName": "fast",
    }
    default = builders.get_model_cache_claim(bms(modelCache={"volume": "PersistentVolumeClaim"}))
    assert default["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}}}
    dep = builders.get_deployment(bms(modelCache={"volume": "PersistentVolumeClaim"}))
    assert pod_spec(dep)["volumes"][0]["persistentVolumeClaim"]["claimName"] == default["metadata"]["name"]


@pytest.mark.parametrize(
    "cache",
    [None, {}, {"volume": "HostPath", "hostPath": "/d"}, {"volume": "PersistentVolumeClaim", "claimName": "mine"}],
)
def test_no_claim_unless_the_operator_creates_it(cache):
    spec = {} if cache is None else {"modelCache": cache}
    assert builders.get_model_cache_claim(bms(**spec)) is None


CREDENTIALS = {
    "huggingFace": {"secretName": "hf-token", "key": "token", "endpoint": "https://hf-mirror.example.com"},
    "s3": {
        "secretName": "s3-models",
        "accessKeyIdKey": "id",
        "secretAccessKeyKey": "secret",
        "endpoint": "http://minio.storage.svc:9000",
        "region": "us-east-1",
    },
}


def test_credentials_env_from_secrets():
    ctr = container(builders.get_deployment(bms(model="hf://org/repo", credentials=CREDENTIALS)))
    env = {e["name"]: e for e in ctr["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "s3-models", "key": "id"}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "s3-models", "key": "secret"}}
    assert env["HF_ENDPOINT"] == {"name": "HF_ENDPOINT", "value": "https://hf-mirror.example.com"}
    assert env["AWS_ENDPOINT_URL"] == {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage.svc:9000"}
    assert env["AWS_REGION"] == {"name": "AWS_REGION", "value": "us-east-1"}
    for name in ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name]  # the kubelet reads the Secret; no value in any manifest


def test_credentials_default_keys_and_optional_parts():
    creds = {"huggingFace": {"secretName": "hf"}, "s3": {"region": "eu-west-1"}}
    env = container(builders.get_deployment(bms(credentials=creds)))["env"]
    names = [e["name"] for e in env]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} in env
    assert "AWS_REGION" in names and "AWS_ACCESS_KEY_ID" not in names  # keys from the pod's identity instead
    assert "HF_ENDPOINT" not in names and "AWS_ENDPOINT_URL" not in names
    s3_only = {"s3": {"secretName": "s3"}}
    env = container(builders.get_deployment(bms(credentials=s3_only)))["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {
        c.ADMIN_TOKEN_ENV: {"name": "smollm2-admin-token", "key": "token"},
        "AWS_ACCESS_KEY_ID": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"},
    }


def test_user_env_comes_last_and_can_override():
    spec = {"credentials": CREDENTIALS, "env": [{"name": "AWS_REGION", "value": "eu-central-1"}]}
    env = container(builders.get_deployment(bms(**spec)))["env"]
    assert env[0]["name"] == "POD_IP" and env[-1] == {"name": "AWS_REGION", "value": "eu-central-1"}


def test_config_hash_rolls_pods_on_model_and_cache_changes():
    base = {**sample()["spec"], "model": "s3://models/a", "modelCache": {"volume": "PersistentVolumeClaim"}}
    base["credentials"] = copy.deepcopy(CREDENTIALS)
    h = builders.config_hash(base)
    assert builders.config_hash({**base, "model": "s3://models/b"}) != h
    assert builders.config_hash({**base, "modelCache": {"volume": "EmptyDir"}}) != h
    assert builders.config_hash({**base, "modelCache": {"volume": "PersistentVolumeClaim", "size": "9Gi"}}) != h
    renamed = copy.deepcopy(base)
    renamed["credentials"]["s3"]["secretName"] = "other"
    assert builders.config_hash(renamed) != h
    # a Secret's contents are not in the spec and never read by the builders: rotating a key keeps the pods
    dep = builders.get_deployment({"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": base})
    assert dep["spec"]["template"]["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION] == h
    assert builders.get_deployment({"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": base}) == dep
    hostpath = {**base, "modelCache": {"volume": "HostPath", "hostPath": "/d"}}
    other = builders.get_deployment({"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": hostpath})
    assert pod_spec(other)["volumes"] != pod_spec(dep)["volumes"]  # the template itself changes, not only the hash
