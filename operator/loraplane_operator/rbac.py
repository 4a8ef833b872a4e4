"""The operator's RBAC rules as data, for the chart and e2e (same content as rbac_rules.yaml)."""

from __future__ import annotations

from typing import Any

_CRUD = ["get", "create", "patch", "update", "delete"]

RULES: list[dict[str, list[str]]] = [
    {"apiGroups": ["loraplane.dev"], "resources": ["basemodelservers", "loraadapters"],
     "verbs": ["get", "list", "watch", "patch", "update"]},
    {"apiGroups": ["loraplane.dev"], "resources": ["basemodelservers/status", "loraadapters/status"],
     "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["loraplane.dev"], "resources": ["basemodelservers/finalizers", "loraadapters/finalizers"],
     "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": _CRUD},
    {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": _CRUD},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": _CRUD},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": _CRUD},
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": _CRUD},
    {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": _CRUD},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": _CRUD},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},  # create: generated admin tokens
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]  # fmt: skip


def cluster_role(name: str = "loraplane-operator") -> dict[str, Any]:
    """A ClusterRole manifest granting exactly RULES."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "loraplane-operator"}},
        "rules": [dict(r) for r in RULES],
    }
