"""Pure manifests of a vLLM BaseModelServer (`spec.engine.kind: vllm`): its pod template, and a LeaderWorkerSet
when one server spans several nodes (`spec.engine.nodes` > 1).

A vLLM pod has two containers in sequence:
- `model-fetch`, an init container of our image: `loraplane pull` fetches spec.model from the same sources and
  credentials as our engine (built-in, a path in the pod, hf://, s3://) into the model cache volume and leaves
  the link `<cache>/served/<server>` to it (so both engine kinds share one cache, in the Hub's layout for hf://);
- `server`: `vllm serve --model <that link>` with runtime LoRA updating on (the operator loads adapters through
  /v1/load_lora_adapter), tensor parallel over the pod's GPUs, pipeline parallel over the nodes (Ray), the
  engine fields vLLM has a flag for, probes on /health, and spec.args last for what we do not model.

Fields vLLM has no equivalent for are refused by the CRD's CEL rules before they get here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from loraplane_operator import builders
from loraplane_operator import constants as c

# engine field -> `vllm serve` flag, for the fields both engines share (same meaning, vLLM's own flag names)
VLLM_FLAGS = {
    "maxLoras": "--max-loras",
    "maxLoraRank": "--max-lora-rank",
    "maxCpuLoras": "--max-cpu-loras",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "maxModelLen": "--max-model-len",
    "gpuMemoryUtilization": "--gpu-memory-utilization",
    "dtype": "--dtype",
}
VLLM_SWITCHES = {"enforceEager": "--enforce-eager"}
RAY_PORT = 6379
SHM_VOLUME = "dshm"  # tensor parallel workers talk through /dev/shm; the container default (64 MiB) is too small
WORKER_COMPONENT = "model-server-worker"


nodes = builders.engine_nodes


def served_link(name: str, spec: Mapping[str, Any]) -> str:
    """The path `loraplane pull` links to the fetched model, which `vllm serve` loads."""
    return f"{builders.cache_mount_path(spec)}/{c.SERVED_LINK_DIR}/{name}"


def served_model_name(spec: Mapping[str, Any]) -> str:
    """The base model's name in vLLM's API, as our server names it: hf://org/repo@rev -> org/repo, a path or
    a built-in name -> its last component."""
    model = str(spec.get("model") or builders.DEFAULT_MODEL).strip().rstrip("/")
    if model.startswith("hf://"):
        org, _, rest = model[len("hf://") :].partition("/")
        return f"{org}/{rest.split('/')[0].split('@')[0]}"
    return model.rsplit("/", 1)[-1] or model


def vllm_args(name: str, spec: Mapping[str, Any]) -> list[str]:
    """`vllm serve` arguments: the fetched model, its name, the address, LoRA on, parallelism, engine fields,
    then spec.args."""
    engine = spec.get("engine") or {}
    gpus = builders.gpu_count(spec)
    # --model rather than `vllm serve`'s positional model tag: the same in both of vLLM's entry points
    args = ["--model", served_link(name, spec), "--served-model-name", served_model_name(spec)]
    args += ["--host", f"$({c.POD_IP_ENV})", "--port", str(builders.server_port(spec)), "--enable-lora"]
    if gpus > 1:
        args += ["--tensor-parallel-size", str(gpus)]
    if nodes(spec) > 1:
        args += ["--pipeline-parallel-size", str(nodes(spec)), "--distributed-executor-backend", "ray"]
    for field, flag in VLLM_FLAGS.items():
        if engine.get(field) is not None:
            args += [flag, str(engine[field])]
    for field, flag in VLLM_SWITCHES.items():
        if engine.get(field) is True:
            args.append(flag)
    return args + [str(a) for a in spec.get("args") or []]


def cache_volume(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """spec.modelCache's volume; an emptyDir without one (the init container needs somewhere to fetch to)."""
    return builders.cache_volume(name, spec) or {"name": c.CACHE_VOLUME, "emptyDir": {}}


def hub_cache(spec: Mapping[str, Any]) -> str:
    """HF_HUB_CACHE of both containers: the Hub's cache layout inside the model cache, as `loraplane serve
    --model-cache` uses it, so a model or adapter fetched by either engine is found by the other."""
    return f"{builders.cache_mount_path(spec)}/hub"


def fetch_container(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The init container: `loraplane pull` of spec.model into the cache volume, linked at served_link."""
    engine = spec.get("engine") or {}
    mount = builders.cache_mount_path(spec)
    args = ["--model", str(spec.get("model") or builders.DEFAULT_MODEL), "--model-cache", mount]
    args += ["--link", served_link(name, spec)]
    return {
        "name": c.FETCH_CONTAINER_NAME,
        "image": engine.get("fetchImage") or builders.DEFAULT_IMAGE,
        "imagePullPolicy": spec.get("imagePullPolicy") or "IfNotPresent",
        "command": list(c.FETCH_COMMAND),
        "args": args,
        "env": [{"name": "HF_HUB_CACHE", "value": hub_cache(spec)}, *builders.credentials_env(spec)],
        "volumeMounts": [{"name": c.CACHE_VOLUME, "mountPath": mount}],
        # `loraplane pull`'s failure line becomes the terminated state's message, read into status.model
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def server_env(name: str, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    engine = spec.get("engine") or {}
    env: list[dict[str, Any]] = [
        {"name": c.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"},
        {"name": "HF_HUB_CACHE", "value": hub_cache(spec)},
    ]
    if builders.gpu_count(spec) == 0 and engine.get("kvCacheGiB") is not None:
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(engine["kvCacheGiB"])})  # GiB, as ours
    ref = builders.admin_token_ref(name, spec)  # the user's Secret only: none is generated for vLLM
    if ref is not None:
        env.append(builders.secret_env(c.VLLM_API_KEY_ENV, *ref))
    return env + builders.credentials_env(spec) + [dict(e) for e in spec.get("env") or []]


def _probe(period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": c.PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def server_container(name: str, spec: Mapping[str, Any], command: list[str] | None = None) -> dict[str, Any]:
    mount = builders.cache_mount_path(spec)
    container: dict[str, Any] = {
        "name": c.CONTAINER_NAME,
        "image": spec.get("image") or c.VLLM_IMAGE,
        "imagePullPolicy": spec.get("imagePullPolicy") or "IfNotPresent",
        "command": command or list(spec.get("command") or c.VLLM_COMMAND),
        "args": [] if command else vllm_args(name, spec),
        "env": server_env(name, spec),
        "ports": [{"name": c.PORT_NAME, "containerPort": builders.server_port(spec), "protocol": "TCP"}],
        # vLLM answers /health once its engine is up (weights loaded, KV cache allocated): up to 30 min for a
        # large model, then readiness and liveness on the same route
        "startupProbe": _probe(10, 180),
        "readinessProbe": _probe(5, 3),
        "livenessProbe": _probe(10, 6),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": c.CACHE_VOLUME, "mountPath": mount},
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        ],
    }
    resources = builders.container_resources(spec)
    if resources:
        container["resources"] = resources
    return container


def pod_spec(name: str, spec: Mapping[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "initContainers": [fetch_container(name, spec)],
        "containers": [container],
        "volumes": [cache_volume(name, spec), {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
        "terminationGracePeriodSeconds": c.TERMINATION_GRACE_S,
    }
    return builders.scheduling(spec, pod)


def get_pod_spec(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The pod of a single-node vLLM server (a Deployment's template)."""
    return pod_spec(name, spec, server_container(name, spec))


# several nodes: a LeaderWorkerSet, Ray across the group, vLLM on the leader
def leader_command(name: str, spec: Mapping[str, Any]) -> list[str]:
    """Start the Ray head, wait until every node of the group has joined, then `vllm serve` on the leader."""
    serve = " ".join(shlex.quote(a) for a in [*(spec.get("command") or c.VLLM_COMMAND), *vllm_args(name, spec)])
    serve = serve.replace(shlex.quote(f"$({c.POD_IP_ENV})"), f"$({c.POD_IP_ENV})")  # the kubelet expands it
    wait = (
        "import ray, sys; ray.init(address='auto', logging_level='ERROR'); "
        "sys.exit(0 if sum(n['Alive'] for n in ray.nodes()) >= int(sys.argv[1]) else 1)"
    )
    script = (
        f"ray start --head --port={RAY_PORT} && "
        f'until python3 -c "{wait}" "$LWS_GROUP_SIZE"; do echo waiting for the group; sleep 5; done && '
        f"exec {serve}"
    )
    return ["/bin/sh", "-c", script]


def worker_container(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A worker node: its GPUs joined to the leader's Ray cluster, nothing served."""
    container = server_container(name, spec)
    container["command"] = ["/bin/sh", "-c", f'exec ray start --address="$LWS_LEADER_ADDRESS:{RAY_PORT}" --block']
    container["args"] = []
    container["ports"] = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        container.pop(probe)
    return container


def get_leader_worker_set(bms: Mapping[str, Any], current_replicas: int | None = None) -> dict[str, Any]:
    """A LeaderWorkerSet of `replicas` groups of `engine.nodes` pods (lws.sigs.k8s.io): the leader runs the
    model fetch and `vllm serve` and carries the server labels (the operator, router and Service talk to
    leaders only); workers join its Ray cluster. A failed pod recreates its whole group."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    labels = builders.server_labels(name)
    worker_labels = {**{k: v for k, v in labels.items() if k != c.SERVER_LABEL}, c.COMPONENT_LABEL: WORKER_COMPONENT}
    annotations = {c.CONFIG_HASH_ANNOTATION: builders.config_hash(spec)}
    worker_pod = builders.scheduling(
        spec,
        {
            "containers": [worker_container(name, spec)],
            "volumes": [cache_volume(name, spec), {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
            "terminationGracePeriodSeconds": c.TERMINATION_GRACE_S,
        },
    )
    lws_spec = {
        "replicas": builders.deployment_replicas(spec, current_replicas),
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": nodes(spec),
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": pod_spec(name, spec, server_container(name, spec, leader_command(name, spec))),
            },
            "workerTemplate": {"metadata": {"labels": worker_labels, "annotations": annotations}, "spec": worker_pod},
        },
    }
    return builders.manifest(c.LWS_API_VERSION, "LeaderWorkerSet", bms, lws_spec)


def get_workload(bms: Mapping[str, Any], current_replicas: int | None = None) -> dict[str, Any]:
    """What runs a server's pods, for either engine kind: our engine's Deployment, vLLM's Deployment, or vLLM's
    LeaderWorkerSet across several nodes. `current_replicas`: the live one's, kept under autoscaling."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    if builders.is_multi_node(spec):
        return get_leader_worker_set(bms, current_replicas)
    if builders.is_vllm(spec):
        return builders.get_deployment(bms, current_replicas, get_pod_spec(name, spec))
    return builders.get_deployment(bms, current_replicas)
