"""Pure BaseModelServer logic: what a server pod looks like to the operator, and the server's status
from its Deployment and pods, with the model's phase (status.model) from the pods' start-up failures and
their /ready reports."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
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
    failure: str | None = None  # why the server cannot start, from its container's state
    last_failure: str | None = None  # why it could not start the time before, while it runs again
    note: str | None = None  # why the pod is not running yet (unscheduled, waiting for a volume or an image)
    config_hash: str | None = None  # of the spec the pod was made from
    stage: str | None = None  # "fetching": its init container pulls the model; "starting": its server starts
    is_terminating: bool = False  # deleted, its containers stopping
    admin_port: int | None = None  # its container port named "admin" (--admin-port); None: admin on the API port

    def url(self, port: int) -> str:
        return builders.pod_url(self.ip or "", port)

    def admin_url(self, port: int) -> str:
        """Where its admin routes answer: its own admin port (each pod says, so pods made before the server had one,
        or before spec.adminPort changed, are still reached), else `port`, the API's (vLLM pods: their LoRA routes)."""
        return self.url(self.admin_port or port)


def pod_info(body: Mapping[str, Any]) -> PodInfo | None:
    """A server pod's identity, IP, readiness, restart count and start-up state; None for pods of no server."""
    meta = body.get("metadata") or {}
    server = (meta.get("labels") or {}).get(c.SERVER_LABEL)
    if not server:
        return None
    status = body.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)
    ip = status.get("podIP") or None
    containers = status.get("containerStatuses") or []
    inits = status.get("initContainerStatuses") or []  # a vLLM pod's model fetch
    restarts = sum(int(s.get("restartCount") or 0) for s in containers)
    return PodInfo(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        server=server,
        uid=meta.get("uid", ""),
        ip=ip,
        is_ready=ready and ip is not None and not meta.get("deletionTimestamp"),
        restarts=restarts,
        failure=next((f for f in map(start_failure, [*inits, *containers]) if f), None),
        last_failure=next((f for f in map(last_start_failure, [*inits, *containers]) if f), None),
        note=pod_note(status),
        config_hash=(meta.get("annotations") or {}).get(c.CONFIG_HASH_ANNOTATION),
        stage=pod_stage(inits, containers),
        is_terminating=bool(meta.get("deletionTimestamp")),
        admin_port=named_port(body, c.ADMIN_PORT_NAME),
    )


def named_port(pod: Mapping[str, Any], name: str) -> int | None:
    """The container port of that name in a pod's spec, None if no container names one so."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name and port.get("containerPort"):
                return int(port["containerPort"])
    return None


def pod_stage(inits: Sequence[Mapping[str, Any]], containers: Sequence[Mapping[str, Any]]) -> str | None:
    """Where a pod is on its way up, from the container states: "fetching" while an init container (a vLLM
    pod's `loraplane pull`) runs, "starting" while the server runs but is not ready yet, else None."""
    if any("running" in (s.get("state") or {}) for s in inits):
        return "fetching"
    if any("running" in (s.get("state") or {}) and not s.get("ready") for s in containers):
        return "starting"
    return None


# why a server pod does not start
MAX_REASON = 1000
_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def redact(text: str) -> str:
    """The server never prints credentials; should a URL with user:password@ reach a status anyway, it is cut."""
    return _URL_USERINFO.sub(r"\1***@", text)[:MAX_REASON]


def failure_line(message: str | None) -> str | None:
    """The reason of the server's `loraplane: failed to start: <reason>` line in a termination message (the
    log's tail under FallbackToLogsOnError: a traceback may come before it), None without that line."""
    if not message or c.FAILURE_PREFIX not in message:
        return None
    rest = message[message.rindex(c.FAILURE_PREFIX) + len(c.FAILURE_PREFIX) :]
    reason = (rest.splitlines() or [""])[0].strip()
    return redact(reason) or None


def _terminated_failure(terminated: Mapping[str, Any]) -> str | None:
    reason = failure_line(terminated.get("message"))
    if reason is None and terminated.get("reason") == "OOMKilled":
        reason = "the server ran out of memory while starting (OOMKilled): raise resources.limits.memory"
    return reason


def start_failure(container: Mapping[str, Any]) -> str | None:
    """A container that ended with the server's failure line (or out of memory), now or before the
    CrashLoopBackOff it waits in; or one that cannot be created (a missing Secret or key). None otherwise,
    e.g. for a container running again after a failure."""
    state = container.get("state") or {}
    if state.get("terminated"):
        return _terminated_failure(state["terminated"])
    waiting = state.get("waiting") or {}
    if waiting.get("reason") == "CrashLoopBackOff":
        return _terminated_failure((container.get("lastState") or {}).get("terminated") or {})
    if waiting.get("reason") == "CreateContainerConfigError":
        detail = str(waiting.get("message") or "its configuration is invalid")[:MAX_REASON]
        return f"the server container cannot be created: {detail} (check spec.credentials and the Secrets)"
    return None


def last_start_failure(container: Mapping[str, Any]) -> str | None:
    """The failure of the run before, for a container started again (not yet failed again)."""
    state = container.get("state") or {}
    if state.get("terminated") or (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
        return None  # start_failure's case
    return _terminated_failure((container.get("lastState") or {}).get("terminated") or {})


def pod_note(status: Mapping[str, Any]) -> str | None:
    """Why a pod is not running yet, as Kubernetes says it: unscheduled (e.g. an unbound claim) or a
    container waiting for something other than its restart."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message') or ''}".strip(": ")[:MAX_REASON]
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "CrashLoopBackOff", "ContainerCreating"):
            return f"{waiting['reason']}: {waiting.get('message') or ''}".strip(": ")[:MAX_REASON]
    return None


# the model's phase
@dataclass(frozen=True)
class ModelReport:
    """What a starting pod's /ready said about its model (server phases: resolving, waiting, downloading,
    verifying, converting, loading, ready; failed with the error when it could not start)."""

    pod: str
    phase: str
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str | None = None
    draft: ModelReport | None = None  # the draft model's (spec.engine.draftModel), "pending" until it starts


SERVER_PHASE_ORDER = ("resolving", "waiting", "downloading", "verifying", "converting", "loading", "ready")
DOWNLOAD_PHASES = frozenset({"resolving", "waiting", "downloading", "verifying", "converting"})
DRAFT_PENDING = "pending"  # a draft model's phase until the server starts on it (after the model's files)


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def model_report(pod: str, body: Any) -> ModelReport | None:
    """The report in a /ready body, None when it says nothing about the model; the draft model's rides on it."""
    if not isinstance(body, dict):
        return None
    if body.get("status") == "failed":
        return ModelReport(pod, "failed", error=redact(str(body.get("error") or "the server failed to start")))
    model = _progress_report(pod, body.get("model"))
    draft = _progress_report(pod, body.get("draft_model"), DRAFT_PENDING)
    return None if model is None else replace(model, draft=draft)


def _progress_report(pod: str, model: Any, *extra: str) -> ModelReport | None:
    if not isinstance(model, dict) or model.get("phase") not in (*SERVER_PHASE_ORDER, *extra):
        return None
    done = _int_or_none(model.get("bytes_done")) or 0
    return ModelReport(pod, str(model["phase"]), done, _int_or_none(model.get("bytes_total")))


def human_bytes(num: int) -> str:
    value, unit = float(num), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{num} B" if unit == "B" else f"{value:.1f} {unit}"


def progress_text(done: int, total: int | None) -> str:
    """e.g. "312.4 MiB/512.0 MiB (61%)"; the bytes alone when the total is unknown."""
    if not total:
        return human_bytes(done)
    return f"{human_bytes(done)}/{human_bytes(total)} ({min(100, done * 100 // total)}%)"


def _most_advanced(reports: Sequence[ModelReport]) -> ModelReport | None:
    live = [r for r in reports if r.phase in SERVER_PHASE_ORDER]
    return max(live, key=lambda r: (SERVER_PHASE_ORDER.index(r.phase), r.bytes_done), default=None)


def _report_message(r: ModelReport) -> str:
    if r.phase == "resolving":
        return f"{r.pod}: resolving the model source"
    if r.phase == "waiting":
        return f"{r.pod}: waiting for another pod's download into the shared cache"
    if r.phase == "downloading":
        return f"{r.pod}: downloading, {progress_text(r.bytes_done, r.bytes_total)}"
    if r.phase in ("verifying", "converting"):
        return f"{r.pod}: {r.phase} the model files"
    if r.phase == "ready":  # loaded, behind its prewarm gate (spec.prewarmGate)
        return f"{r.pod}: loaded, prewarming its adapters before it takes traffic"
    return f"{r.pod}: loading the weights into memory"


def _with_bytes(model: dict[str, Any], done: int | None, total: int | None) -> dict[str, Any]:
    if done is not None:
        model.update(bytesDone=done, progress=progress_text(done, total))
    if total is not None:
        model["bytesTotal"] = total
    return model


def current_pods(pods: Iterable[PodInfo], spec: Mapping[str, Any]) -> list[PodInfo]:
    """The pods of the spec as it is (an older spec's pods say nothing about this model), by name."""
    want = builders.config_hash(spec)
    by_name = {p.name: p for p in pods if p.config_hash in (None, want)}
    return [by_name[n] for n in sorted(by_name)]


def _failure(pod: PodInfo, reports: Sequence[ModelReport]) -> str | None:
    """The pod's start-up failure; one from its run before holds until its new run shows progress (so the
    phase does not flap between restarts of a server that fails again)."""
    if pod.failure or not pod.last_failure:
        return pod.failure
    report = next((r for r in reports if r.pod == pod.name), None)
    moving = report is not None and (report.bytes_done > 0 or report.phase not in ("waiting", "downloading"))
    return None if moving else pod.last_failure


def model_phase(
    pods: Sequence[PodInfo], reports: Sequence[ModelReport], previous: Mapping[str, Any], by_stage: bool = False
) -> dict[str, Any]:
    """phase, message, reason and bytes of the model: Ready when a pod is ready; else Failed when a pod could
    not start; else Downloading or Loading from the most advanced /ready report, or with `by_stage` (vLLM pods,
    whose /ready says nothing) from the containers' states; else Pending."""
    ready = [p for p in pods if p.is_ready]
    if ready:
        total = _int_or_none(previous.get("bytesTotal"))
        model = {"phase": "Ready", "message": f"{ready[0].name}: loaded ({len(ready)} pods ready)"}
        return _with_bytes(model, total, total)
    failed = [(p.name, f) for p in pods if (f := _failure(p, reports))] + [(r.pod, r.error) for r in reports if r.error]
    if failed:
        pod, reason = failed[0]
        return {"phase": "Failed", "reason": reason, "message": f"{pod}: the server failed to start: {reason}"}
    best = _most_advanced(reports)
    if best is not None:
        phase = "Downloading" if best.phase in DOWNLOAD_PHASES else "Loading"
        return _with_bytes({"phase": phase, "message": _report_message(best)}, best.bytes_done, best.bytes_total)
    # pods that report nothing on /ready (vLLM's): the phase from their containers
    reported = {r.pod for r in reports} if by_stage else {p.name for p in pods}
    starting = [p for p in pods if p.name not in reported and p.stage == "starting"]
    if starting:
        return {"phase": "Loading", "message": f"{starting[0].name}: the server is loading the model"}
    fetching = [p for p in pods if p.name not in reported and p.stage == "fetching"]
    if fetching:
        message = f"{fetching[0].name}: fetching the model into the cache ({c.FETCH_CONTAINER_NAME})"
        return {"phase": "Downloading", "message": message}
    queued = [r.pod for r in reports if r.phase == DRAFT_PENDING]
    if queued:
        return {"phase": "Pending", "message": f"{queued[0]}: the draft model is fetched once the model's files are"}
    notes = [f"{p.name}: {p.note}" for p in pods if p.note]
    return {"phase": "Pending", "message": notes[0] if notes else "no server pod has reported its model yet"}


def model_status(
    spec: Mapping[str, Any],
    pods: Sequence[PodInfo],
    reports: Sequence[ModelReport],
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """status.model for spec.model, keeping lastTransitionTime (and the size) while the phase and source hold."""
    model = str(spec.get("model") or builders.DEFAULT_MODEL)
    return _source_status(model, pods, reports, previous, now, by_stage=builders.is_vllm(spec))


def draft_model_status(
    spec: Mapping[str, Any],
    pods: Sequence[PodInfo],
    reports: Sequence[ModelReport],
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any] | None:
    """status.draftModel for spec.engine.draftModel (None without one), as status.model is for the model: from
    the draft's own report in each /ready; a server that could not start fails both."""
    source = (spec.get("engine") or {}).get("draftModel")
    if not source:
        return None
    drafts = [r if r.error else r.draft for r in reports if r.error or r.draft]
    return _source_status(str(source), pods, [r for r in drafts if r is not None], previous, now)


def _source_status(
    source: str,
    pods: Sequence[PodInfo],
    reports: Sequence[ModelReport],
    previous: Mapping[str, Any],
    now: str,
    by_stage: bool = False,
) -> dict[str, Any]:
    same_source = previous.get("source") == source
    model = {"source": source, **model_phase(pods, reports, previous if same_source else {}, by_stage)}
    same = same_source and previous.get("phase") == model["phase"]
    model["lastTransitionTime"] = previous.get("lastTransitionTime") if same else now
    return model


def ready_pods(pods: Iterable[PodInfo], warming: Iterable[PodInfo] = ()) -> list[PodInfo]:
    """Ready pods with an IP, by name (one entry per pod name even if an index holds stale twins), and the
    `warming` ones: loaded, held out of rotation while the operator prewarms them (they count for placement)."""
    by_name = {p.name: p for p in pods if p.is_ready and p.ip}
    by_name.update({p.name: p for p in warming if p.ip and p.name not in by_name})
    return [by_name[n] for n in sorted(by_name)]


def is_starting(pod: PodInfo) -> bool:
    """A pod whose server runs but is not Ready yet (loading, or loaded and waiting for its prewarm)."""
    return pod.stage == "starting" and pod.ip is not None and not pod.is_ready and not pod.is_terminating


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


def _condition(
    kind: str, is_true: bool, reason: str, message: str, previous: Mapping[str, Any], now: str, generation: Any
) -> dict[str, Any]:
    flag = "True" if is_true else "False"
    old = next((x for x in previous.get("conditions") or [] if x.get("type") == kind), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == flag else None
    condition = {"type": kind, "status": flag, "reason": reason, "message": message, "lastTransitionTime": since or now}
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def server_status(
    bms: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    pods: Sequence[PodInfo],
    previous: Mapping[str, Any],
    now: str,
    reports: Sequence[ModelReport] = (),
) -> dict[str, Any]:
    """The BaseModelServer status: replica counts, selector, endpoints, phase, the model, and the Ready and
    ModelReady conditions. `reports`: the /ready answers of the current spec's starting pods."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    dep_status = (deployment or {}).get("status") or {}
    dep_spec = (deployment or {}).get("spec") or {}
    desired = int(dep_spec.get("replicas", spec.get("replicas", 1)))
    phase, message = server_phase(deployment, desired)
    current = current_pods(pods, spec)
    model = model_status(spec, current, reports, previous.get("model") or {}, now)
    draft = draft_model_status(spec, current, reports, previous.get("draftModel") or {}, now)
    if model["phase"] == c.PHASE_FAILED and not ready_pods(pods):
        phase, message = c.PHASE_FAILED, f"the model failed to load: {model['reason']}"
    port = builders.server_port(spec)
    generation = (bms.get("metadata") or {}).get("generation")
    return {
        "phase": phase,
        "message": message,
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
        "selector": builders.selector_string(name),
        "autoscaling": builders.autoscaler_kind(spec),
        "endpoints": {p.name: p.url(port) for p in ready_pods(pods)},
        "model": model,
        **({"draftModel": draft} if draft is not None else {}),
        "conditions": [
            _condition("Ready", phase == c.PHASE_READY, phase, message, previous, now, generation),
            _condition(
                "ModelReady",
                model["phase"] == c.PHASE_READY,
                model["phase"],
                model["message"],
                previous,
                now,
                generation,
            ),
        ],
    }


@dataclass(frozen=True)
class ServerRef:
    """What adapters need from their BaseModelServer: where its pods listen and where the admin token is."""

    name: str
    namespace: str
    port: int
    token_secret: str | None = None
    token_key: str = "token"
    engine: str = c.ENGINE_LORAPLANE  # spec.engine.kind: which client talks to its pods
    is_gated: bool = False  # its pods wait, loaded, for the operator's prewarm before they turn Ready


def server_ref(bms: Mapping[str, Any]) -> ServerRef:
    meta, spec = bms["metadata"], bms.get("spec") or {}
    ref = builders.admin_token_ref(meta["name"], spec)
    return ServerRef(
        name=meta["name"],
        namespace=meta.get("namespace", ""),
        port=builders.server_port(spec),
        token_secret=ref[0] if ref else None,
        token_key=ref[1] if ref else c.TOKEN_KEY,
        engine=builders.engine_kind(spec),
        is_gated=builders.prewarm_timeout_s(spec) > 0,
    )
