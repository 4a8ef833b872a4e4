"""Pure manifests of a BaseModelServer's router (`spec.router.enabled`): a Deployment of `loraplane router`
finding the server pods through the API server, its Service, and a ServiceAccount with a Role that reads the
pods of its namespace and nothing else. Its pods carry no server label, so nothing takes them for servers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kopf import Body

from loraplane_operator import builders
from loraplane_operator import constants as c

ROUTER_COMPONENT = "router"
ROUTER_LABEL = f"{c.GROUP}/router"
DEFAULT_ROUTER_COMMAND = ("loraplane", "router")
ROUTER_PORT = 8080
# (api version, kind) of every router object, for deleting them when the router is switched off
ROUTER_KINDS = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("v1", "ServiceAccount"),
)


def router_name(server: str) -> str:
    return f"{server}-router"


def is_router_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("router") or {}).get("enabled"))


def router_selector_labels(server: str) -> dict[str, str]:
    return {c.NAME_LABEL: c.APP_NAME, ROUTER_LABEL: server}


def router_labels(server: str) -> dict[str, str]:
    return {
        **router_selector_labels(server),
        c.INSTANCE_LABEL: server,
        c.COMPONENT_LABEL: ROUTER_COMPONENT,
        c.MANAGED_BY_LABEL: c.MANAGED_BY,
    }


def router_args(namespace: str, server: str, spec: Mapping[str, Any]) -> list[str]:
    """The router's flags; `--engine vllm` in front of vLLM pods, whose residency and load it reads otherwise."""
    router = spec.get("router") or {}
    args = [
        "--namespace", namespace,
        "--selector", builders.selector_string(server),
        "--pod-port", str(builders.server_port(spec)),
        "--host", f"$({c.POD_IP_ENV})",  # the pod's own address, as the server binds
        "--port", str(ROUTER_PORT),
        "--epsilon", str(router.get("epsilon", 0.5)),
        "--spill-queue", str(router.get("spillQueue", 8)),
        "--hold-timeout", str(router.get("holdTimeoutSeconds", 120)),
        "--hold-max", str(router.get("holdMaxRequests", 256)),
    ]  # fmt: skip
    if builders.engine_kind(spec) == c.ENGINE_VLLM:
        args += ["--engine", c.ENGINE_VLLM]
    return args  # residency from each server pod's own "admin" container port, where it names one


def get_router_deployment(bms: Body) -> dict[str, Any]:
    meta, spec = bms["metadata"], bms.get("spec") or {}
    server, namespace = meta["name"], meta.get("namespace") or "default"
    router = spec.get("router") or {}
    env: list[dict[str, Any]] = [{"name": c.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    ref = builders.admin_token_ref(server, spec)
    if ref is not None:  # the servers' residency needs their admin token (/v1/adapters; on vLLM, /v1/models: its key)
        env.append(builders.secret_env(c.ADMIN_TOKEN_ENV, *ref))
    container: dict[str, Any] = {
        "name": ROUTER_COMPONENT,
        "image": router.get("image") or spec.get("image") or builders.DEFAULT_IMAGE,
        "imagePullPolicy": spec.get("imagePullPolicy") or "IfNotPresent",
        "command": list(router.get("command") or DEFAULT_ROUTER_COMMAND),
        "args": router_args(namespace, server, spec),
        "env": env,
        "ports": [{"name": c.PORT_NAME, "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": c.PORT_NAME}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": c.PORT_NAME}, "periodSeconds": 10},
    }
    if router.get("resources"):
        container["resources"] = dict(router["resources"])
    container["securityContext"] = builders.container_security(read_only=True)  # the router writes no file
    pod: dict[str, Any] = {"serviceAccountName": router_name(server), "containers": [container]}
    pod["securityContext"] = builders.pod_security()
    pod = builders.scheduling(spec, pod, server=False)  # its own account and placement, not the GPU servers'
    dep_spec = {
        "replicas": int(router.get("replicas", 2)),
        "selector": {"matchLabels": router_selector_labels(server)},
        "template": {"metadata": {"labels": router_labels(server)}, "spec": pod},
    }
    return _manifest("apps/v1", "Deployment", bms, dep_spec)


def get_router_service(bms: Body) -> dict[str, Any]:
    server = bms["metadata"]["name"]
    port = builders.server_port(bms.get("spec") or {})  # clients keep the server's port
    svc_spec = {
        "type": "ClusterIP",
        "selector": router_selector_labels(server),
        "ports": [{"name": c.PORT_NAME, "port": port, "targetPort": c.PORT_NAME, "protocol": "TCP"}],
    }
    return _manifest("v1", "Service", bms, svc_spec)


def get_router_rbac(bms: Body) -> list[dict[str, Any]]:
    """ServiceAccount, Role (get, list and watch pods of this namespace) and the RoleBinding between them."""
    name = router_name(bms["metadata"]["name"])
    account = _manifest("v1", "ServiceAccount", bms, None)
    role = _manifest("rbac.authorization.k8s.io/v1", "Role", bms, None)
    role["rules"] = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]  # all the router does
    binding = _manifest("rbac.authorization.k8s.io/v1", "RoleBinding", bms, None)
    binding["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    binding["subjects"] = [{"kind": "ServiceAccount", "name": name, "namespace": account["metadata"]["namespace"]}]
    return [account, role, binding]


def get_router_objects(bms: Body) -> list[dict[str, Any]]:
    """Everything the router needs, or nothing when it is off."""
    if not is_router_enabled(bms.get("spec") or {}):
        return []
    return [*get_router_rbac(bms), get_router_deployment(bms), get_router_service(bms)]


def _manifest(api_version: str, kind: str, bms: Body, spec: dict[str, Any] | None) -> dict[str, Any]:
    meta = bms["metadata"]
    metadata = {
        "name": router_name(meta["name"]),
        "namespace": meta.get("namespace") or "default",
        "labels": router_labels(meta["name"]),
    }
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "metadata": metadata}
    if spec is not None:
        obj["spec"] = spec
    return obj
