"""Issue 39, least privilege measured rather than argued: the real API server's audit log (e2e/cluster.py's policy:
every request of a ServiceAccount outside kube-system) holds each request the operator made under its own accounts
during this e2e run: the operator process's (`install_operator_rbac`) and the chart's operator pods'. Held against
the rules the chart grants (loraplane_operator.rbac.RULES, and the chart's Lease rule for leader election):

- nothing the operator asked for was refused by the authorizer (a missing rule, or code asking for more than it
  needs; the 403s of admission, such as a create in a namespace being deleted, are not RBAC's);
- every granted (group, resource, verb) was used by the operator, except those rbac.NOT_EXERCISED names with the
  reason this cluster cannot exercise them: a grant nothing uses is a right too many.

It runs after every other e2e module (conftest orders it last), and only when the modules that run the operator ran.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.operator_fixtures import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE
from e2e.test_autoscaling import OPERATOR_USER as AUTOSCALING_USER
from e2e.test_autoscaling import UNINSTALLS as AUTOSCALING_UNINSTALLS
from e2e.test_helm import FULLNAME as HELM_ACCOUNT
from e2e.test_helm import NAMESPACE as HELM_NAMESPACE
from e2e.test_helm import UNINSTALLS
from loraplane_operator import rbac

pytestmark = pytest.mark.e2e

OPERATOR_USERS = {
    f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}",
    f"system:serviceaccount:{HELM_NAMESPACE}:{HELM_ACCOUNT}",
    AUTOSCALING_USER,  # the chart's operator that test_autoscaling installs (KEDA's ScaledObjects are its)
}
# the modules that run an operator: without all of them the log says too little about what it uses
OPERATOR_MODULES = {"test_operator", "test_operator_residency", "test_helm", "test_router", "test_autoscaling"}
LEASE_RULE = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}

Grant = tuple[str, str, str]  # (API group, resource[/subresource], verb)
# what the built-in ClusterRole system:basic-user grants every authenticated user: asking who one is, or what one
# may do, needs no rule of ours
EVERYONE: set[Grant] = {
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
}


def granted() -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in [*rbac.RULES, LEASE_RULE]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def operator_requests(log: Path) -> list[dict[str, Any]]:
    """The operator's resource requests (not discovery) from the audit log."""
    events = (json.loads(line) for line in log.read_text().splitlines() if line.strip())
    return [e for e in events if e.get("user", {}).get("username") in OPERATOR_USERS and e.get("objectRef")]


def grants_of(event: dict[str, Any]) -> list[Grant]:
    """What the API server authorized for one request: its verb, and `create` too for a server-side apply that
    created the object (201: the patch handler authorizes create inline, with no event of its own)."""
    ref = event["objectRef"]
    resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    group, verb = ref.get("apiGroup", ""), event["verb"]
    created = verb == "patch" and event.get("responseStatus", {}).get("code") == 201
    return [(group, resource, verb)] + ([(group, resource, "create")] if created else [])


HELM_USER = f"system:serviceaccount:{HELM_NAMESPACE}:{HELM_ACCOUNT}"


def forbidden(event: dict[str, Any]) -> bool:
    """Refused by RBAC while the account held its rules: the authorizer's decision, not a 403 of admission (a
    namespace being deleted refuses every create in it with a 403 that no rule could grant), and not a chart
    operator's after its `helm uninstall` began (its pods stop after helm deleted their RoleBinding): test_helm's
    release and test_autoscaling's."""
    if (event.get("annotations") or {}).get("authorization.k8s.io/decision") != "forbid":
        return False
    uninstalls = {HELM_USER: UNINSTALLS, AUTOSCALING_USER: AUTOSCALING_UNINSTALLS}.get(event["user"]["username"])
    if uninstalls:
        return datetime.fromisoformat(event["requestReceivedTimestamp"]) < uninstalls[0]
    return True


def test_the_operator_used_every_right_it_holds_and_asked_for_none_it_lacks(
    cluster: LocalCluster, request: pytest.FixtureRequest
) -> None:
    ran = {Path(str(item.fspath)).stem for item in request.session.items}
    if not OPERATOR_MODULES <= ran:
        pytest.skip(f"needs the whole e2e run: {sorted(OPERATOR_MODULES - ran)} did not run")
    events = operator_requests(cluster.audit_log)
    assert events, f"no request of {sorted(OPERATOR_USERS)} in {cluster.audit_log}"
    used = Counter(g for e in events if not forbidden(e) for g in grants_of(e))
    refused = Counter(g for e in events if forbidden(e) for g in grants_of(e))
    print(json.dumps({"/".join(g): n for g, n in sorted(used.items())}, indent=1))
    unused = granted() - set(used) - set(rbac.NOT_EXERCISED)
    exercised_anyway = set(rbac.NOT_EXERCISED) & set(used)
    beyond = set(used) - granted() - EVERYONE
    checks = {  # all of them at once: one e2e run says everything to change
        "the operator asked for rights it does not hold": dict(refused),
        "granted but never used by the operator (remove them, or say in NOT_EXERCISED why)": sorted(unused),
        "used after all, take them out of NOT_EXERCISED": sorted(exercised_anyway),
        "used without a rule of ours (another binding?)": sorted(beyond),
    }
    problems = [f"{what}: {found}" for what, found in checks.items() if found]
    assert not problems, "\n".join(problems)
