"""The operator's RBAC rules as data: the one source of rbac_rules.yaml and the chart's copy, both generated from
it (`python -m loraplane_operator.rbac`), and of e2e's operator account. e2e/test_rbac_audit.py holds them
against the real API server's audit log of a whole e2e run: every right here was used by the operator, but those
NOT_EXERCISED names with the reason, and it asked for none it lacks.

    python -m loraplane_operator.rbac           # rewrite both YAML files
    python -m loraplane_operator.rbac --check   # exit 1 if either differs from RULES
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# each child kind: server-side apply (patch; create when it makes the object) and delete when the spec drops it
_APPLY = ["create", "patch", "delete"]

RULES: list[dict[str, list[str]]] = [
    # kopf lists and watches them and patches its finalizers and annotations; the operator patches their status
    {"apiGroups": ["loraplane.dev"], "resources": ["basemodelservers", "loraadapters"],
     "verbs": ["list", "watch", "patch"]},
    {"apiGroups": ["loraplane.dev"], "resources": ["basemodelservers/status", "loraadapters/status"],
     "verbs": ["patch"]},
    {"apiGroups": ["loraplane.dev"], "resources": ["basemodelservers/finalizers", "loraadapters/finalizers"],
     "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", *_APPLY]},  # get: replicas, readiness
    {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": _APPLY},  # the router's
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": _APPLY},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": _APPLY},
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": _APPLY},
    {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": ["get", *_APPLY]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": _APPLY},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": _APPLY},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},  # create: generated admin tokens
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},  # kopf's events on the objects
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]  # fmt: skip


# rights the e2e cluster cannot exercise, with why (e2e/test_rbac_audit.py checks the rest were all used)
_OWNER_REFS = (
    "checked, not requested: the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift and hardened "
    "clusters, off in e2e's API server) asks it of whoever sets blockOwnerDeletion on a child (kopf.adopt does)"
)
_NO_HPA = (
    "autoscaling.kind hpa needs prometheus-adapter, which the Go module proxy does not serve: e2e scales through "
    "KEDA (its ScaledObjects are used); the plain HPA is built in unit tests; its delete, of one the spec dropped, "
    "is used"
)
_NO_LWS = (
    "a LeaderWorkerSet is a multi-node vLLM server's workload (GPUs, the LWS controller): e2e runs neither; "
    "its delete, of one the spec dropped, is used"
)
NOT_EXERCISED: dict[tuple[str, str, str], str] = {
    ("loraplane.dev", "basemodelservers/finalizers", "update"): _OWNER_REFS,
    ("loraplane.dev", "loraadapters/finalizers", "update"): _OWNER_REFS,
    ("autoscaling", "horizontalpodautoscalers", "create"): _NO_HPA,
    ("autoscaling", "horizontalpodautoscalers", "patch"): _NO_HPA,
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "create"): _NO_LWS,
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "patch"): _NO_LWS,
    ("leaderworkerset.x-k8s.io", "leaderworkersets", "get"): _NO_LWS + " (get: its replicas and status)",
}

PACKAGE_YAML = Path(__file__).with_name("rbac_rules.yaml")
CHART_YAML = Path(__file__).resolve().parents[2] / "helm" / "loraplane" / "files" / "rbac_rules.yaml"
HEADER = """# Least-privilege rules for the loraplane operator's ClusterRole (or a Role, when it watches one namespace).
# Generated from loraplane_operator.rbac.RULES by `python -m loraplane_operator.rbac`: edit RULES, not this file.
"""


def _flow(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' if i == "" else i for i in items) + "]"


def render_yaml() -> str:
    """RULES as the YAML both files hold (flow lists, one rule a block)."""
    lines = [HEADER.rstrip("\n")]
    for rule in RULES:
        lines += [f"- apiGroups: {_flow(rule['apiGroups'])}", f"  resources: {_flow(rule['resources'])}"]
        lines.append(f"  verbs: {_flow(rule['verbs'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render_yaml()
    stale = [p for p in (PACKAGE_YAML, CHART_YAML) if not p.exists() or p.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} differs from loraplane_operator.rbac.RULES: run python -m loraplane_operator.rbac")
        return 1 if stale else 0
    for path in stale:
        if path.parent.is_dir():  # the chart is not there in an installed package
            path.write_text(text)
            print(f"wrote {path}")
    return 0


def cluster_role(name: str = "loraplane-operator") -> dict[str, Any]:
    """A ClusterRole manifest granting exactly RULES."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "loraplane-operator"}},
        "rules": [dict(r) for r in RULES],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
