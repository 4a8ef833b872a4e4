"""Pure manifest builders for a BaseModelServer: Deployment, Service, HPA, KEDA ScaledObject and the model
cache's PersistentVolumeClaim.

Each `get_*` takes the BaseModelServer body (metadata + spec, CRD defaults applied or not) and returns a
manifest dict with no owner references; the handlers adopt and apply it. No I/O here.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

from loraplane_operator import constants as c

Body = Mapping[str, Any]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_IMAGE = "loraplane:latest"
DEFAULT_PORT = 8080
DEFAULT_CACHE_MOUNT = "/var/cache/loraplane-models"
DEFAULT_CLAIM_SIZE = "20Gi"
DEFAULT_CLAIM_ACCESS = ("ReadWriteMany",)  # replicas on several nodes share one download

# engine field -> `loraplane serve` flag
ENGINE_FLAGS = {
    "maxLoras": "--max-loras",
    "maxLoraRank": "--max-lora-rank",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "maxModelLen": "--max-model-len",
    "kvCacheGiB": "--kv-cache-gib",
    "gpuMemoryUtilization": "--gpu-memory-utilization",
    "hostCacheBytes": "--host-cache-bytes",
    "diskCacheBytes": "--disk-cache-bytes",
    "dtype": "--dtype",
    "quantization": "--quantization",
    "speculative": "--speculative",
    "draftModel": "--draft-model",  # the server resolves it as --model: same credentials env and model cache
    "maxQueue": "--max-queue",
}
# boolean engine field -> `loraplane serve` store_true flag: true passes the flag, false passes nothing
ENGINE_SWITCHES = {
    "enforceEager": "--enforce-eager",
}
# spec fields that do not change the pod template (scaling is not a new configuration)
UNHASHED_FIELDS = ("replicas", "autoscaling", "networkPolicy", "disruptionBudget")  # no pod is made of these


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select a server's pods (immutable on the Deployment: never change them)."""
    return {c.NAME_LABEL: c.APP_NAME, c.SERVER_LABEL: name}


def server_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        c.INSTANCE_LABEL: name,
        c.COMPONENT_LABEL: c.COMPONENT,
        c.MANAGED_BY_LABEL: c.MANAGED_BY,
    }


def selector_string(name: str) -> str:
    """`k=v,k=v`, as the scale subresource's labelSelectorPath wants it."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def pod_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}"


def server_port(spec: Mapping[str, Any]) -> int:
    return int(spec.get("port") or DEFAULT_PORT)


def config_hash(spec: Mapping[str, Any]) -> str:
    """A short digest of everything in the spec that shapes a pod; replicas and autoscaling excluded."""
    relevant = {k: v for k, v in spec.items() if k not in UNHASHED_FIELDS}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def gpu_count(spec: Mapping[str, Any]) -> int:
    """spec.resources.gpus, 1 when left out (the CRD's default)."""
    return int((spec.get("resources") or {}).get("gpus", 1))


def device_flag(spec: Mapping[str, Any]) -> str:
    """`--device` from the GPUs the pod requests: cuda with a GPU (the server then fails at start without a
    usable one, never falling back to the CPU), cpu without (no CUDA probe)."""
    return "cuda" if gpu_count(spec) > 0 else "cpu"


def engine_args(engine: Mapping[str, Any]) -> list[str]:
    """spec.engine as flags; fields left out keep the server's defaults."""
    args: list[str] = []
    for field, flag in ENGINE_FLAGS.items():
        if engine.get(field) is not None:
            args += [flag, str(engine[field])]
    for field, flag in ENGINE_SWITCHES.items():
        if engine.get(field) is True:
            args.append(flag)
    return args


def server_args(spec: Mapping[str, Any]) -> list[str]:
    """The flags after the command: model, model cache, device, address, engine settings, allowed adapter
    sources, extras."""
    args = ["--model", str(spec.get("model") or DEFAULT_MODEL)]
    if spec.get("modelCache") is not None:
        args += ["--model-cache", cache_mount_path(spec)]
    args += ["--device", device_flag(spec)]
    args += ["--host", f"$({c.POD_IP_ENV})", "--port", str(server_port(spec))]
    args += ["--admin-port", str(admin_port(spec))]
    args += engine_args(spec.get("engine") or {})
    timeout = prewarm_timeout_s(spec)
    if timeout:
        args += ["--prewarm-timeout", str(timeout)]
    for prefix in spec.get("adapterSourceAllow") or []:
        args += ["--adapter-source-allow", str(prefix)]
    return args + [str(a) for a in spec.get("args") or []]


def admin_port(spec: Mapping[str, Any]) -> int:
    """Where the server pods serve the admin routes (--admin-port, spec.adminPort): apart from the API's port,
    so that the NetworkPolicy can open it to the operator and the router only. A vLLM pod's LoRA routes share
    its API port (guarded by its --api-key)."""
    if is_vllm(spec):
        return server_port(spec)
    return int(spec.get("adminPort") or c.DEFAULT_ADMIN_PORT)


def prewarm_timeout_s(spec: Mapping[str, Any]) -> int:
    """spec.prewarmGate: how long a loaded pod may stay out of rotation while the operator prewarms its adapters
    (0: the gate is off, a pod is Ready once its model is loaded). vLLM pods have no gate (their readiness is
    vLLM's own)."""
    gate = spec.get("prewarmGate") or {}
    if is_vllm(spec) or gate.get("enabled") is False:
        return 0
    return int(gate.get("timeoutSeconds", c.PREWARM_TIMEOUT_S))


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    """An env var read from a Secret by the kubelet: the value never enters a manifest."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def credentials_env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """HF_TOKEN / AWS_* from the credentials' Secrets, plus the endpoints and region as plain values."""
    creds = spec.get("credentials") or {}
    env: list[dict[str, Any]] = []
    hf = creds.get("huggingFace") or {}
    if hf.get("secretName"):
        env.append(secret_env(c.HF_TOKEN_ENV, hf["secretName"], hf.get("key") or c.HF_TOKEN_ENV))
    if hf.get("endpoint"):
        env.append({"name": "HF_ENDPOINT", "value": str(hf["endpoint"])})
    s3 = creds.get("s3") or {}
    if s3.get("secretName"):
        env.append(secret_env(c.AWS_KEY_ID_ENV, s3["secretName"], s3.get("accessKeyIdKey") or c.AWS_KEY_ID_ENV))
        key = s3.get("secretAccessKeyKey") or c.AWS_SECRET_ENV
        env.append(secret_env(c.AWS_SECRET_ENV, s3["secretName"], key))
    if s3.get("endpoint"):
        env.append({"name": "AWS_ENDPOINT_URL", "value": str(s3["endpoint"])})
    if s3.get("region"):
        env.append({"name": "AWS_REGION", "value": str(s3["region"])})
    return env


def _env(name: str, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": c.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if spec.get("modelCache") is not None:
        # hf:// models into the Hub's layout on the cache volume (the server honours HF_HUB_CACHE before
        # --model-cache, and the image sets HF_HOME): one download for every replica and either engine kind
        env.append({"name": "HF_HUB_CACHE", "value": f"{cache_mount_path(spec)}/hub"})
    ref = admin_token_ref(name, spec)
    if ref is not None:
        env.append(secret_env(c.ADMIN_TOKEN_ENV, *ref))
    return env + credentials_env(spec) + [dict(e) for e in spec.get("env") or []]


# the admin token: the user's Secret, or one the operator makes, so the admin API is never open
def generated_token_secret(name: str) -> str:
    return f"{name}-admin-token"


def admin_token_ref(name: str, spec: Mapping[str, Any]) -> tuple[str, str] | None:
    """(Secret, key) of the server's admin token: spec.adminTokenSecretRef, else the Secret the operator makes for
    our engine. None for a vLLM server without one: vLLM's key guards inference too, so it stays the user's call."""
    ref = spec.get("adminTokenSecretRef")
    if ref:
        return str(ref["name"]), str(ref.get("key") or c.TOKEN_KEY)
    return None if is_vllm(spec) else (generated_token_secret(name), c.TOKEN_KEY)


def get_admin_token_secret(bms: Body) -> dict[str, Any] | None:
    """The Secret with a random admin token (256 bits) for a server without adminTokenSecretRef, else None. Created
    once (apply_children never overwrites it: a new value each reconcile would lock the pods out)."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    if spec.get("adminTokenSecretRef") or admin_token_ref(name, spec) is None:
        return None
    obj = manifest("v1", "Secret", bms, {})
    del obj["spec"]
    obj["metadata"]["name"] = generated_token_secret(name)
    obj["type"] = "Opaque"
    obj["stringData"] = {c.TOKEN_KEY: secrets.token_urlsafe(32)}
    return obj


# model cache
def cache_mount_path(spec: Mapping[str, Any]) -> str:
    return str((spec.get("modelCache") or {}).get("mountPath") or DEFAULT_CACHE_MOUNT)


def cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def is_created_claim(spec: Mapping[str, Any]) -> bool:
    """A PersistentVolumeClaim cache without claimName: the operator creates and owns the claim."""
    cache = spec.get("modelCache")
    return cache is not None and cache.get("volume") == "PersistentVolumeClaim" and not cache.get("claimName")


def cache_volume(name: str, spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod volume `model-cache` the spec asks for, None without spec.modelCache."""
    cache = spec.get("modelCache")
    if cache is None:
        return None
    kind = cache.get("volume") or "EmptyDir"
    if kind == "PersistentVolumeClaim":
        source: dict[str, Any] = {
            "persistentVolumeClaim": {"claimName": cache.get("claimName") or cache_claim_name(name)}
        }
    elif kind == "HostPath":
        source = {"hostPath": {"path": cache["hostPath"], "type": "DirectoryOrCreate"}}
    else:
        source = {"emptyDir": {"sizeLimit": str(cache["size"])} if cache.get("size") else {}}
    return {"name": c.CACHE_VOLUME, **source}


def get_model_cache_claim(bms: Body) -> dict[str, Any] | None:
    """The claim the operator creates for a PersistentVolumeClaim cache without claimName, else None."""
    spec = bms.get("spec") or {}
    if not is_created_claim(spec):
        return None
    cache = spec["modelCache"]
    claim: dict[str, Any] = {
        "accessModes": list(cache.get("accessModes") or DEFAULT_CLAIM_ACCESS),
        "resources": {"requests": {"storage": str(cache.get("size") or DEFAULT_CLAIM_SIZE)}},
    }
    if cache.get("storageClassName"):
        claim["storageClassName"] = cache["storageClassName"]
    obj = manifest("v1", "PersistentVolumeClaim", bms, claim)
    obj["metadata"]["name"] = cache_claim_name(bms["metadata"]["name"])
    return obj


def container_resources(spec: Mapping[str, Any]) -> dict[str, Any]:
    res = spec.get("resources") or {}
    requests = dict(res.get("requests") or {})
    limits = dict(res.get("limits") or {})
    gpus = gpu_count(spec)
    if gpus > 0:
        limits[c.GPU_RESOURCE] = gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": c.PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def get_container(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": c.CONTAINER_NAME,
        "image": spec.get("image") or DEFAULT_IMAGE,
        "imagePullPolicy": spec.get("imagePullPolicy") or "IfNotPresent",
        "command": list(spec.get("command") or c.DEFAULT_COMMAND),
        "args": server_args(spec),
        "env": _env(name, spec),
        "ports": [
            {"name": c.PORT_NAME, "containerPort": server_port(spec), "protocol": "TCP"},
            {"name": c.ADMIN_PORT_NAME, "containerPort": admin_port(spec), "protocol": "TCP"},
        ],
        "readinessProbe": _probe("/ready", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        # a start-up failure's last log line becomes the terminated state's message, read into status.model
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    has_cache = spec.get("modelCache") is not None
    mounts = [{"name": c.CACHE_VOLUME, "mountPath": cache_mount_path(spec)}] if has_cache else []
    mounts += [{"name": volume, "mountPath": path} for volume, path in writable_dirs(spec)]
    if mounts:
        container["volumeMounts"] = mounts
    container["securityContext"] = container_security(read_only_root(spec))
    resources = container_resources(spec)
    if resources:
        container["resources"] = resources
    return container


def get_pod_spec(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The pod of our engine (vllm_builders makes vLLM's)."""
    pod: dict[str, Any] = {
        "containers": [get_container(name, spec)],
        "terminationGracePeriodSeconds": c.TERMINATION_GRACE_S,
        "securityContext": pod_security(),
    }
    volume = cache_volume(name, spec)
    volumes = [volume] if volume is not None else []
    volumes += [{"name": volume, "emptyDir": {}} for volume, _ in writable_dirs(spec)]
    if volumes:
        pod["volumes"] = volumes
    return scheduling(spec, pod)


# hardening: what Pod Security's `restricted` level asks of a pod, and a read-only root filesystem
def read_only_root(spec: Mapping[str, Any]) -> bool:
    """spec.pod.readOnlyRootFilesystem, true when left out (the CRD's default)."""
    return bool((spec.get("pod") or {}).get("readOnlyRootFilesystem", True))


def writable_dirs(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(volume, mount path) of the emptyDirs a read-only root needs; none where the root is writable, and none on
    the model cache's own mount path."""
    if not read_only_root(spec):
        return []
    taken = cache_mount_path(spec) if spec.get("modelCache") is not None else None
    return [(volume, path) for volume, path in c.WRITABLE_DIRS if path != taken]


def pod_security() -> dict[str, Any]:
    """Non-root as the images' user (uid 10001, which owns /cache in the server image), volumes writable by its
    group, the container runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": c.RUN_AS_UID,
        "runAsGroup": c.RUN_AS_UID,
        "fsGroup": c.RUN_AS_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(read_only: bool) -> dict[str, Any]:
    """No privilege escalation, every capability dropped, the root filesystem read-only unless turned off."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only,
    }


# scheduling
PLACEMENT_FIELDS = ("affinity", "topologySpreadConstraints")  # where the server pods go: not the router's
POD_FIELDS = ("priorityClassName", "imagePullSecrets")  # the server's and the router's pods alike


def scheduling(spec: Mapping[str, Any], pod: dict[str, Any], server: bool = True) -> dict[str, Any]:
    """The pod with spec.pod's priority class and image pull secrets and, for the server pods (`server`), the node
    selector and tolerations (top level and spec.pod's), affinity, topology spread and service account. The
    router's pods keep their own account and go wherever the scheduler puts them, off the GPU nodes."""
    extra = spec.get("pod") or {}
    fields: tuple[str, ...] = POD_FIELDS
    if server:
        fields = (*PLACEMENT_FIELDS, *POD_FIELDS)
        selector = {**(spec.get("nodeSelector") or {}), **(extra.get("nodeSelector") or {})}
        if selector:
            pod["nodeSelector"] = selector
        tolerations = [dict(t) for t in [*(spec.get("tolerations") or []), *(extra.get("tolerations") or [])]]
        if tolerations:
            pod["tolerations"] = tolerations
        if spec.get("serviceAccountName"):
            pod["serviceAccountName"] = spec["serviceAccountName"]
    for field in fields:
        if extra.get(field):
            pod[field] = json.loads(json.dumps(extra[field]))  # a deep copy of plain JSON
    return pod


def get_disruption_budget(bms: Body) -> dict[str, Any] | None:
    """A PodDisruptionBudget over the server pods (maxUnavailable 1 by default), None when turned off. A node
    drain then evicts one server pod at a time, and the Deployment replaces it before the next goes."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    budget = spec.get("disruptionBudget") or {}
    if budget.get("enabled") is False:
        return None
    pdb_spec = {
        "maxUnavailable": budget.get("maxUnavailable", 1),
        "selector": {"matchLabels": selector_labels(name)},
    }
    return manifest("policy/v1", "PodDisruptionBudget", bms, pdb_spec)


def is_autoscaled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def autoscaler_kind(spec: Mapping[str, Any]) -> str:
    """The autoscaler in force: off, hpa or keda (the BaseModelServer's AUTOSCALING column)."""
    return _autoscaling(spec)["kind"] if is_autoscaled(spec) else "off"


def deployment_replicas(spec: Mapping[str, Any], current: int | None) -> int:
    """spec.replicas; under autoscaling the live count (clamped to the bounds), so applying the Deployment
    never resets what the autoscaler chose (omitting the field would reset it to 1 under server-side apply)."""
    if not is_autoscaled(spec):
        return int(spec.get("replicas", 1))
    a = _autoscaling(spec)
    value = int(spec.get("replicas", 1)) if current is None else current
    return max(a["min"], min(a["max"], value))


# engine kinds
def engine_kind(spec: Mapping[str, Any]) -> str:
    """spec.engine.kind: loraplane (the default) or vllm."""
    return str((spec.get("engine") or {}).get("kind") or c.ENGINE_LORAPLANE)


def is_vllm(spec: Mapping[str, Any]) -> bool:
    return engine_kind(spec) == c.ENGINE_VLLM


def engine_nodes(spec: Mapping[str, Any]) -> int:
    """Nodes one server spans (vLLM pipeline parallel through a LeaderWorkerSet); 1 for a Deployment's pods."""
    return int((spec.get("engine") or {}).get("nodes") or 1) if is_vllm(spec) else 1


def is_multi_node(spec: Mapping[str, Any]) -> bool:
    return engine_nodes(spec) > 1


def workload_kind(spec: Mapping[str, Any]) -> tuple[str, str]:
    """(apiVersion, kind) of the object that runs the server pods: a Deployment, or a LeaderWorkerSet for a
    vLLM server spanning several nodes."""
    return (c.LWS_API_VERSION, "LeaderWorkerSet") if is_multi_node(spec) else ("apps/v1", "Deployment")


def get_deployment(bms: Body, current_replicas: int | None = None, pod: dict[str, Any] | None = None) -> dict[str, Any]:
    """The server Deployment. `current_replicas`: the live Deployment's, kept under autoscaling. `pod`: the
    template's spec (vLLM's), else our engine's."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    labels = server_labels(name)
    dep_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {
            "metadata": {"labels": labels, "annotations": {c.CONFIG_HASH_ANNOTATION: config_hash(spec)}},
            "spec": pod if pod is not None else get_pod_spec(name, spec),
        },
    }
    dep_spec["replicas"] = deployment_replicas(spec, current_replicas)
    return manifest("apps/v1", "Deployment", bms, dep_spec)


def get_service(bms: Body) -> dict[str, Any]:
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    port = server_port(spec)
    svc_spec = {
        "type": "ClusterIP",
        "selector": selector_labels(name),
        "ports": [{"name": c.PORT_NAME, "port": port, "targetPort": c.PORT_NAME, "protocol": "TCP"}],
    }
    return manifest("v1", "Service", bms, svc_spec)


def _autoscaling(spec: Mapping[str, Any]) -> dict[str, Any]:
    a = spec.get("autoscaling") or {}
    return {
        "kind": a.get("kind", "hpa"),
        "min": int(a.get("minReplicas", 1)),
        "max": int(a.get("maxReplicas", 4)),
        "target": int(a.get("targetQueueDepth", 8)),
        "stabilization": int(a.get("scaleDownStabilizationSeconds", 300)),
        "prometheus": a.get("prometheusAddress") or "http://prometheus-operated.monitoring.svc:9090",
        "query": a.get("query"),
        "polling": int(a.get("pollingIntervalSeconds", 30)),
    }


def get_hpa(bms: Body) -> dict[str, Any]:
    """autoscaling/v2 HPA on the per-pod loraplane_queue_depth (served by prometheus-adapter)."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    a = _autoscaling(spec)
    hpa_spec = {
        "scaleTargetRef": scale_target(name, spec),
        "minReplicas": a["min"],
        "maxReplicas": a["max"],
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": hpa_metric(spec)},
                    "target": {"type": "AverageValue", "averageValue": str(a["target"])},
                },
            }
        ],
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": a["stabilization"]}},
    }
    return manifest(c.HPA_API_VERSION, "HorizontalPodAutoscaler", bms, hpa_spec)


def scale_target(name: str, spec: Mapping[str, Any]) -> dict[str, str]:
    api_version, kind = workload_kind(spec)
    return {"apiVersion": api_version, "kind": kind, "name": name}


def queue_metric(spec: Mapping[str, Any]) -> str:
    """The pods' queue-depth gauge as Prometheus stores it: ours, or vLLM's requests waiting."""
    return c.VLLM_QUEUE_METRIC if is_vllm(spec) else c.QUEUE_DEPTH_METRIC


def hpa_metric(spec: Mapping[str, Any]) -> str:
    """The same gauge through prometheus-adapter (the chart's rule renames vLLM's: no ':' in a metric name)."""
    return c.VLLM_HPA_METRIC if is_vllm(spec) else c.QUEUE_DEPTH_METRIC


def _pod_sum(metric: str, namespace: str, pods: str) -> str:
    """A gauge summed over the pods whose names match `pods` in the namespace."""
    return f'sum({metric}{{namespace="{namespace}",pod=~"{pods}"}})'


def queue_depth_query(namespace: str, name: str, spec: Mapping[str, Any] | None = None) -> str:
    return _pod_sum(queue_metric(spec or {}), namespace, f"{name}-.*")


def running_query(namespace: str, name: str, spec: Mapping[str, Any]) -> str:
    """Requests the server pods are generating (none waiting is not idle: a pool at zero must not drop them)."""
    return _pod_sum(c.VLLM_RUNNING_METRIC if is_vllm(spec) else c.RUNNING_METRIC, namespace, f"{name}-.*")


def held_query(namespace: str, name: str) -> str:
    """Requests the server's router pods hold while no server pod is Ready: what wakes a pool at zero."""
    return _pod_sum(c.ROUTER_HELD_METRIC, namespace, f"{name}-router-.*")


def _prometheus_trigger(name: str, address: str, query: str, threshold: int) -> dict[str, Any]:
    # activationThreshold 0 (KEDA's default, written out): a trigger is active while its value is above 0
    metadata = {"serverAddress": address, "query": query, "threshold": str(threshold), "activationThreshold": "0"}
    return {"type": "prometheus", "name": name, "metricType": "AverageValue", "metadata": metadata}


def get_scaled_object(bms: Body) -> dict[str, Any]:
    """KEDA ScaledObject with Prometheus triggers; AverageValue divides a summed value by the replicas (KEDA's
    HPA takes the most replicas any trigger asks for).

    The queue: the server pods' waiting requests, targetQueueDepth a pod. With minReplicas 0 two more: the
    requests the router holds while no pod is Ready (they count as queued; their count above 0 wakes the pool
    from zero), and the requests running (threshold maxNumSeqs a pod: never more pods than the queue asks, but
    the pool stays up while any runs). KEDA scales to zero once every trigger has been 0 for cooldownPeriod
    (the scale-down stabilization)."""
    meta = bms["metadata"]
    name, namespace = meta["name"], meta.get("namespace") or "default"
    spec = bms.get("spec") or {}
    a = _autoscaling(spec)
    triggers = [
        _prometheus_trigger(
            "queue", a["prometheus"], a["query"] or queue_depth_query(namespace, name, spec), a["target"]
        )
    ]
    so_spec: dict[str, Any] = {
        "scaleTargetRef": scale_target(name, spec),
        "minReplicaCount": a["min"],
        "maxReplicaCount": a["max"],
        "pollingInterval": a["polling"],
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": a["stabilization"]}},
            },
        },
        "triggers": triggers,
    }
    if a["min"] == 0:
        max_num_seqs = int((spec.get("engine") or {}).get("maxNumSeqs") or c.DEFAULT_MAX_NUM_SEQS)
        triggers.append(_prometheus_trigger("held", a["prometheus"], held_query(namespace, name), a["target"]))
        triggers.append(
            _prometheus_trigger("running", a["prometheus"], running_query(namespace, name, spec), max_num_seqs)
        )
        so_spec["cooldownPeriod"] = a["stabilization"]
    return manifest(c.KEDA_API_VERSION, "ScaledObject", bms, so_spec)


def get_autoscaler(bms: Body) -> dict[str, Any] | None:
    """The HPA or ScaledObject the spec asks for, or None."""
    spec = bms.get("spec") or {}
    if not is_autoscaled(spec):
        return None
    return get_scaled_object(bms) if _autoscaling(spec)["kind"] == "keda" else get_hpa(bms)


def manifest(api_version: str, kind: str, bms: Body, spec: dict[str, Any]) -> dict[str, Any]:
    meta = bms["metadata"]
    metadata: dict[str, Any] = {"name": meta["name"], "labels": server_labels(meta["name"])}
    if meta.get("namespace"):
        metadata["namespace"] = meta["namespace"]
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": spec}
