"""A container's environment as the kubelet builds it, and Kubernetes' `$(VAR)` expansion."""

from __future__ import annotations

import base64
from typing import Any

from e2e.api import ApiClient, ApiError


class ConfigError(RuntimeError):
    """The container cannot start yet (CreateContainerConfigError): a missing Secret or key."""


def expand(text: str, env: dict[str, str]) -> str:
    """`$(NAME)` becomes env[NAME] when defined (else stays as is); `$$` becomes `$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env.get(name, text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def build_env(api: ApiClient, pod: dict[str, Any], container: dict[str, Any], base: dict[str, str]) -> dict[str, str]:
    """`base` (the kubelet's own variables) + envFrom + env, each value expanded against those before it."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for key, value in _env_from(api, namespace, source).items():
            env[prefix + key] = value
    for var in container.get("env", []):
        if "valueFrom" in var:
            resolved = _value_from(api, pod, container, var["valueFrom"])
            if resolved is not None:
                env[var["name"]] = resolved
        else:
            env[var["name"]] = expand(var.get("value", ""), env)
    return env


def field_value(pod: dict[str, Any], field_path: str) -> str:
    """A downward-API field such as `status.podIP` or `metadata.labels['app']`."""
    for prefix in ("labels", "annotations"):
        start = f"metadata.{prefix}['"
        if field_path.startswith(start):
            return str(pod["metadata"].get(prefix, {}).get(field_path[len(start) : -2], ""))
    node: Any = pod
    for part in field_path.split("."):
        node = node.get(part, "") if isinstance(node, dict) else ""
    if isinstance(node, list):  # status.podIPs
        return ",".join(item["ip"] for item in node)
    return str(node)


def _value_from(api: ApiClient, pod: dict[str, Any], container: dict[str, Any], source: dict[str, Any]) -> str | None:
    namespace = pod["metadata"]["namespace"]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in source:
        kind, _, name = source["resourceFieldRef"]["resource"].partition(".")
        return str(container.get("resources", {}).get(kind, {}).get(name, "0"))
    ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
    assert ref, f"unsupported valueFrom: {source}"
    data = _object_data(api, namespace, "secrets" if "secretKeyRef" in source else "configmaps", ref)
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"key {ref['key']!r} of {ref['name']!r} not found in namespace {namespace}")
    return data[ref["key"]]


def _env_from(api: ApiClient, namespace: str, source: dict[str, Any]) -> dict[str, str]:
    ref = source.get("secretRef") or source.get("configMapRef") or {}
    data = _object_data(api, namespace, "secrets" if "secretRef" in source else "configmaps", ref)
    if data is None and not ref.get("optional"):
        raise ConfigError(f"{ref.get('name')!r} not found in namespace {namespace}")
    return data or {}


def _object_data(api: ApiClient, namespace: str, resource: str, ref: dict[str, Any]) -> dict[str, str] | None:
    try:
        obj = api.get(f"/api/v1/namespaces/{namespace}/{resource}/{ref['name']}")
    except ApiError as error:
        if error.status == 404:
            return None
        raise
    if resource == "secrets":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return dict(obj.get("data", {}))
