"""The router's manifests (operator/router_builders.py): nothing when off; when on, a Deployment of
`loraplane router` that finds the server pods by their selector, its Service on the server's port, and a
ServiceAccount whose Role reads pods and nothing else; its pods are never taken for server pods; `--engine vllm`
in front of vLLM pods."""

from __future__ import annotations

from loraplane_operator import builders, rbac, router_builders
from loraplane_operator import constants as c
from loraplane_operator.kube import PLURALS
from loraplane_operator.router_builders import get_router_objects


def bms(**spec) -> dict:
    return {"metadata": {"name": "smollm2", "namespace": "ml", "uid": "u1"}, "spec": {"model": "smollm2-135m", **spec}}


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_off_by_default() -> None:
    assert get_router_objects(bms()) == [] and get_router_objects(bms(router={"enabled": False})) == []


def test_on_makes_every_object_named_for_the_server() -> None:
    objs = by_kind(get_router_objects(bms(router={"enabled": True}, port=9000)))
    assert set(objs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    assert {o["metadata"]["name"] for o in objs.values()} == {"smollm2-router"}
    assert {o["metadata"]["namespace"] for o in objs.values()} == {"ml"}
    assert all(o["kind"] in PLURALS for o in objs.values())  # the operator can apply and delete each


def test_deployment_runs_the_router_on_the_server_pods() -> None:
    spec = {"enabled": True, "replicas": 3, "epsilon": 0.5, "spillQueue": 4}
    dep = by_kind(get_router_objects(bms(router=spec, adminTokenSecretRef={"name": "admin"}, port=9000)))["Deployment"]
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 3 and pod["spec"]["serviceAccountName"] == "smollm2-router"
    assert container["command"] == ["loraplane", "router"]
    args = container["args"]
    flag = {args[i]: args[i + 1] for i in range(0, len(args), 2)}
    assert flag["--namespace"] == "ml" and flag["--selector"] == builders.selector_string("smollm2")
    assert flag["--pod-port"] == "9000" and flag["--epsilon"] == "0.5" and flag["--spill-queue"] == "4"
    assert (flag["--hold-timeout"], flag["--hold-max"]) == ("120", "256")  # a pool with no Ready pod: held, bounded
    assert "--pod-admin-port" not in flag  # each server pod names its admin port: old and new pods both read
    assert flag["--host"] == f"$({c.POD_IP_ENV})"  # the pod's own address
    assert container["env"] == [
        {"name": c.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": c.ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}},
    ]  # the servers' admin token, from the Secret: residency needs it
    labels = pod["metadata"]["labels"]
    assert c.SERVER_LABEL not in labels  # never one of the server pods (the operator prewarms those)
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    server_selector = builders.selector_labels("smollm2")
    assert not server_selector.items() <= labels.items()  # the server Service does not select router pods


def test_service_keeps_the_server_port_and_selects_the_router() -> None:
    svc = by_kind(get_router_objects(bms(router={"enabled": True}, port=9000)))["Service"]
    assert svc["spec"]["ports"][0]["port"] == 9000 and svc["spec"]["ports"][0]["targetPort"] == c.PORT_NAME
    assert svc["spec"]["selector"] == router_builders.router_selector_labels("smollm2")


def test_the_role_reads_pods_and_nothing_else() -> None:
    objs = by_kind(get_router_objects(bms(router={"enabled": True})))
    assert objs["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = objs["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "smollm2-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "smollm2-router", "namespace": "ml"}]


def test_the_operator_may_create_and_delete_what_the_router_needs() -> None:
    """RBAC escalation: the operator can only grant what it holds (every right of the router's Role; the audit
    of e2e never sees that check, it is not a request), and it must be able to manage every router kind."""
    granted = {
        (group, resource, verb)
        for rule in rbac.RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for kind, resource, group in (
        ("ServiceAccount", "serviceaccounts", ""),
        ("Role", "roles", "rbac.authorization.k8s.io"),
        ("RoleBinding", "rolebindings", "rbac.authorization.k8s.io"),
        ("Deployment", "deployments", "apps"),
        ("Service", "services", ""),
    ):
        assert PLURALS[kind] == resource
        assert {(group, resource, v) for v in ("create", "patch", "delete")} <= granted, kind  # apply, drop
    role = by_kind(get_router_objects(bms(router={"enabled": True})))["Role"]
    granting = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert granting <= granted


def router_flags(**spec: object) -> list[str]:
    dep = by_kind(get_router_objects(bms(router={"enabled": True}, **spec)))["Deployment"]
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_router_reads_vllm_pods_as_vllm() -> None:
    spec = {"router": {"enabled": True}, "engine": {"kind": "vllm"}, "adminTokenSecretRef": {"name": "admin"}}
    container = by_kind(get_router_objects(bms(**spec)))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args, env = container["args"], container["env"]
    assert args[-2:] == ["--engine", "vllm"] and args.count("--engine") == 1
    # the Secret that is vLLM's --api-key is the router's admin token: its /v1/models poll sends it
    assert {"name": c.ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}} in env
    for other in ({}, {"engine": {"kind": "loraplane"}}, {"engine": {}}):  # our server: no new flag
        assert "--engine" not in router_flags(**other)
    assert router_flags(engine={"kind": "loraplane"}) == router_flags()
