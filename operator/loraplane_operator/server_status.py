"""Pure BaseModelServer logic: what a server pod looks like to the operator, and the server's status
from its Deployment and pods."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loraplane_operator import builders
from loraplane_operator import constants as c


@dataclass(frozen=True)
class PodInfo:
    """A server pod, as indexed by (namespace, server)."""

    name: str
    namespace: str
    server: str
    uid: str
    ip: str | None
    is_ready: bool
    restarts: int

    def url(self, port: int) -> str:
        return builders.pod_url(self.ip or "", port)


def pod_info(body: Mapping[str, Any]) -> PodInfo | None:
    """A server pod's identity, IP, readiness and restart count; None for pods of no server."""
    meta = body.get("metadata") or {}
    server = (meta.get("labels") or {}).get(c.SERVER_LABEL)
    if not server:
        return None
    status = body.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)
    ip = status.get("podIP") or None
    restarts = sum(int(s.get("restartCount") or 0) for s in status.get("containerStatuses") or [])
    return PodInfo(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        server=server,
        uid=meta.get("uid", ""),
        ip=ip,
        is_ready=ready and ip is not None and not meta.get("deletionTimestamp"),
        restarts=restarts,
    )


def ready_pods(pods: Iterable[PodInfo]) -> list[PodInfo]:
    """Ready pods with an IP, by name (one entry per pod name even if an index holds stale twins)."""
    by_name = {p.name: p for p in pods if p.is_ready and p.ip}
    return [by_name[n] for n in sorted(by_name)]


def _deployment_condition(deployment: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    conditions = (deployment.get("status") or {}).get("conditions") or []
    return next((x for x in conditions if x.get("type") == kind), None)


def server_phase(deployment: Mapping[str, Any] | None, desired: int) -> tuple[str, str]:
    """(phase, message) from the Deployment's status."""
    if deployment is None:
        return c.PHASE_PENDING, "the Deployment does not exist yet"
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    progressing = _deployment_condition(deployment, "Progressing")
    if progressing and progressing.get("reason") == "ProgressDeadlineExceeded":
        return c.PHASE_FAILED, str(progressing.get("message") or "the rollout exceeded its progress deadline")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if failure and failure.get("status") == "True":
        return c.PHASE_FAILED, str(failure.get("message") or "pods cannot be created")
    if ready >= desired and updated >= desired:
        return c.PHASE_READY, f"{ready}/{desired} pods ready"
    if ready == 0:
        return c.PHASE_PENDING, f"0/{desired} pods ready"
    if updated < desired:
        return c.SERVER_PROGRESSING, f"rolling out: {updated}/{desired} updated, {ready} ready"
    return c.PHASE_DEGRADED, f"{ready}/{desired} pods ready"


def server_status(
    bms: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    pods: Sequence[PodInfo],
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """The BaseModelServer status: replica counts, selector, endpoints, phase and the Ready condition."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    dep_status = (deployment or {}).get("status") or {}
    dep_spec = (deployment or {}).get("spec") or {}
    desired = int(dep_spec.get("replicas", spec.get("replicas", 1)))
    phase, message = server_phase(deployment, desired)
    port = builders.server_port(spec)
    ready_flag = "True" if phase == c.PHASE_READY else "False"
    old = next((x for x in previous.get("conditions") or [] if x.get("type") == "Ready"), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == ready_flag else None
    generation = (bms.get("metadata") or {}).get("generation")
    condition = {
        "type": "Ready",
        "status": ready_flag,
        "reason": phase,
        "message": message,
        "lastTransitionTime": since or now,
    }
    status: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
        "selector": builders.selector_string(name),
        "endpoints": {p.name: p.url(port) for p in ready_pods(pods)},
        "conditions": [condition],
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return status


@dataclass(frozen=True)
class ServerRef:
    """What adapters need from their BaseModelServer: where its pods listen and where the admin token is."""

    name: str
    namespace: str
    port: int
    token_secret: str | None = None
    token_key: str = "token"


def server_ref(bms: Mapping[str, Any]) -> ServerRef:
    meta, spec = bms["metadata"], bms.get("spec") or {}
    ref = spec.get("adminTokenSecretRef") or {}
    return ServerRef(
        name=meta["name"],
        namespace=meta.get("namespace", ""),
        port=builders.server_port(spec),
        token_secret=ref.get("name"),
        token_key=ref.get("key") or "token",
    )
