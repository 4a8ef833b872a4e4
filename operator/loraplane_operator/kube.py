"""Kubernetes API calls (kubernetes_asyncio): server-side apply of any manifest, delete, reads, status
patches. The only module that talks to the API server besides kopf itself."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from loraplane_operator import constants as c

# kind -> plural of everything the operator applies
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": c.KEDA_PLURAL,
    "LeaderWorkerSet": "leaderworkersets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    c.BMS_KIND: c.BMS_PLURAL,
    c.LORA_KIND: c.LORA_PLURAL,
}
_JSON = "application/json"


async def make_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    return client.ApiClient()


def resource_path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    """/api/v1/... for the core group, /apis/<group>/<version>/... for the others."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


async def _call(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: list[tuple[str, str]] | None = None,
    content_type: str = _JSON,
) -> Any:
    return await api.call_api(
        path,
        method,
        query_params=query or [],
        header_params={"Accept": _JSON, "Content-Type": content_type},
        body=body,
        response_types_map={200: "object", 201: "object"},
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
    )


async def apply(api: client.ApiClient, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply as the operator's field manager (idempotent; creates or updates)."""
    meta = obj["metadata"]
    path = resource_path(obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"], meta["name"])
    query = [("fieldManager", c.FIELD_MANAGER), ("force", "true")]
    return await _call(api, "PATCH", path, dict(obj), query, "application/apply-patch+yaml")


async def create_if_absent(api: client.ApiClient, obj: Mapping[str, Any]) -> bool:
    """POST one object; False if one of that name exists already (left exactly as it is)."""
    meta = obj["metadata"]
    try:
        await _call(api, "POST", resource_path(obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"]), dict(obj))
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


async def delete_if_exists(api: client.ApiClient, api_version: str, kind: str, namespace: str, name: str) -> bool:
    """Delete one object; False if it was not there (or its API, e.g. KEDA's, is not installed)."""
    try:
        await _call(api, "DELETE", resource_path(api_version, PLURALS[kind], namespace, name))
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def get(api: client.ApiClient, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
    try:
        return await _call(api, "GET", resource_path(api_version, PLURALS[kind], namespace, name))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def patch_status(api: client.ApiClient, kind: str, namespace: str, name: str, status: dict) -> None:
    """JSON merge patch of a loraplane.dev object's status subresource."""
    path = resource_path(c.API_VERSION, PLURALS[kind], namespace, name) + "/status"
    await _call(api, "PATCH", path, {"status": status}, None, "application/merge-patch+json")


async def read_secret_key(api: client.ApiClient, namespace: str, name: str, key: str) -> str:
    """One key of a Secret, decoded; KeyError if the key is missing."""
    secret = await _call(api, "GET", resource_path("v1", "secrets", namespace, name))
    data = (secret or {}).get("data") or {}
    if key not in data:
        raise KeyError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data[key]).decode().strip()
