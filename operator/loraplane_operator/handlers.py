"""Thin kopf handlers: unpack, call a builder or a reconcile function, apply, report.

BaseModelServer: create/update/resume apply the model cache's claim, the Deployment, Service and autoscaler
(owned, server-side applied); a timer mirrors the Deployment, the pods and the model's phase (read from the
starting pods' /ready) into the status, with an Event when the model's phase changes.
LoRAAdapter: one daemon per adapter runs reconcile rounds (now on spec changes and on a new retry annotation,
every few seconds while loading, with backoff after failures, every ADAPTER_RESYNC_S otherwise); delete
unloads it from every pod (the finalizer). Server pods: a gated server's starting pod is prewarmed before it
turns Ready (warmer.py); any other pod that turns Ready or restarts gets every adapter of its server again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from loraplane_operator import adapter_status as st
from loraplane_operator import (
    builders,
    kube,
    metrics,
    network_builders,
    reconcile,
    router_builders,
    vllm_builders,
    warmer,
)
from loraplane_operator import constants as c
from loraplane_operator.context import OperatorContext
from loraplane_operator.server_status import (
    PodInfo,
    ServerRef,
    current_pods,
    is_starting,
    pod_info,
    server_ref,
    server_status,
)

BMS = (c.GROUP, c.VERSION, c.BMS_PLURAL)
LORA = (c.GROUP, c.VERSION, c.LORA_PLURAL)
SERVER_PODS = {c.MANAGED_BY_LABEL: c.MANAGED_BY}
SERVER_STATUS_KEYS = frozenset(
    {"phase", "message", "replicas", "readyReplicas", "selector", "endpoints", "model", "draftModel", "autoscaling"}
)


def _ctx(memo: kopf.Memo) -> OperatorContext:
    return memo["ctx"]


def _first(index: kopf.Index, key: Hashable) -> Any:
    store = index.get(key)
    return next(iter(store), None) if store else None


def _api_error(exc: ApiException, what: str) -> kopf.TemporaryError | kopf.PermanentError:
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    message = f"{what}: {exc.status} {exc.reason}: {body[:300]}"
    if exc.status == 404:
        return kopf.PermanentError(f"{message} (is the API installed? kind: keda needs KEDA)")
    if exc.status in (400, 422):  # a manifest the API server refuses: only a spec change helps
        return kopf.PermanentError(message)
    return kopf.TemporaryError(message, delay=10)


# indexes: kept in memory by kopf from its watches, read by every handler
@kopf.index(*BMS)
def servers(body: kopf.Body, **_: Any) -> dict:
    ref = server_ref(body)
    return {(ref.namespace, ref.name): ref}


@kopf.index("v1", "pods", labels=SERVER_PODS)
def server_pods(body: kopf.Body, **_: Any) -> dict:
    info = pod_info(body)
    return {} if info is None else {(info.namespace, info.server): info}


@kopf.index(*LORA)
def adapters(name: str, namespace: str | None, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, **_: Any) -> dict:
    """The adapters a (re)started pod of their server gets; a Failed one is not re-sent until retried."""
    if meta.get("deletionTimestamp") or not spec.get("source") or status.get("phase") == c.PHASE_FAILED:
        return {}
    return {(namespace or "", spec.get("baseModelServer")): (name, st.adapter_want(name, spec))}


# BaseModelServer
@kopf.on.resume(*BMS, backoff=10)
@kopf.on.create(*BMS, backoff=10)
@kopf.on.update(*BMS, field="spec", backoff=10)
async def apply_server(
    body: kopf.Body,
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    meta: kopf.Meta,
    memo: kopf.Memo,
    patch: kopf.Patch,
    **_: Any,
) -> None:
    """Model cache claim (if created) + Deployment + Service (+ HPA or ScaledObject) (+ PodDisruptionBudget)
    (+ NetworkPolicy) (+ the router), owned by the BaseModelServer, applied idempotently."""
    ctx, namespace = _ctx(memo), namespace or ""
    with metrics.reconcile(c.BMS_KIND):
        objs = await _apply_server(ctx, body, name, namespace, spec)
    patch.status["observedGeneration"] = meta.get("generation")
    patch.status["selector"] = builders.selector_string(name)
    kopf.info(body, reason="Applied", message=", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objs))


async def _apply_server(
    ctx: OperatorContext, body: kopf.Body, name: str, namespace: str, spec: kopf.Spec
) -> list[dict[str, Any]]:
    try:
        autoscaled = builders.is_autoscaled(spec)
        live = await reconcile.current_replicas(ctx, namespace, name, spec) if autoscaled else None
        # the claim and the token first: the pods need them when they start
        objs = [o for o in (builders.get_model_cache_claim(body), builders.get_admin_token_secret(body)) if o]
        objs += [vllm_builders.get_workload(body, live), builders.get_service(body)]
        objs += [o for o in (builders.get_autoscaler(body), builders.get_disruption_budget(body)) if o is not None]
        policy = network_builders.get_network_policy(body, ctx.peer)
        objs += [policy] if policy is not None else []
        objs += router_builders.get_router_objects(body)
        kopf.adopt(objs, owner=body)
        await reconcile.apply_children(ctx, objs, namespace, name)
    except ApiException as exc:
        error = _api_error(exc, "applying the server's children")
        if isinstance(error, kopf.TemporaryError):
            metrics.RETRIES.labels(c.BMS_KIND).inc()
        raise error from exc
    return objs


@kopf.timer(*BMS, interval=c.SERVER_RESYNC_S)  # type: ignore[arg-type]  # index kwargs are not in kopf's protocols
async def server_status_timer(
    body: kopf.Body,
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: kopf.Memo,
    patch: kopf.Patch,
    server_pods: kopf.Index,
    **_: Any,
) -> None:
    """Mirror the Deployment, the Ready pods and the model's phase into the BaseModelServer's status."""
    ctx, namespace = _ctx(memo), namespace or ""
    deployment = await kube.get(ctx.api, *builders.workload_kind(spec), namespace, name)  # or its LeaderWorkerSet
    pods: list[PodInfo] = list(server_pods.get((namespace, name), []))
    reports = await reconcile.model_reports(ctx, current_pods(pods, spec), builders.server_port(spec))
    new = server_status(body, deployment, pods, status, reconcile.now_iso(), reports)
    for key, value in st.status_patch(status, new, SERVER_STATUS_KEYS).items():
        patch.status[key] = value
    _report_model(body, status.get("model") or {}, new["model"])
    if "draftModel" in new:
        _report_model(body, status.get("draftModel") or {}, new["draftModel"], "DraftModel")


def _report_model(body: kopf.Body, before: Mapping[str, Any], model: Mapping[str, Any], kind: str = "Model") -> None:
    """An Event when the model's (or the draft model's) phase or source changes: Downloading, Loading, Ready, or
    Failed (a warning with the reason). Nothing while it holds, however long a download takes."""
    if (before.get("phase"), before.get("source")) == (model["phase"], model["source"]):
        return
    message = f"{model['source']}: {model['message']}"[:1000]
    if model["phase"] == c.PHASE_FAILED:
        kopf.warn(body, reason=f"{kind}Failed", message=message)
    elif model["phase"] != c.PHASE_PENDING:
        kopf.info(body, reason=f"{kind}{model['phase']}", message=message)


# LoRAAdapter
@kopf.daemon(*LORA, cancellation_timeout=5)  # type: ignore[arg-type]  # index kwargs are not in kopf's protocols
async def adapter_daemon(
    stopped: kopf.DaemonStopped,
    body: kopf.Body,
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    memo: kopf.Memo,
    logger: kopf.Logger,
    servers: kopf.Index,
    server_pods: kopf.Index,
    **_: Any,
) -> None:
    """Reconcile rounds until the adapter is deleted (spec, meta and the indexes are live views)."""
    ctx, namespace = _ctx(memo), namespace or ""
    wake = ctx.wakeup(namespace, name)
    current = dict(status)
    while not stopped:
        wake.clear()
        key = (namespace, spec.get("baseModelServer"))
        server: ServerRef | None = _first(servers, key)
        try:
            retry = (meta.get("annotations") or {}).get(c.RETRY_ANNOTATION)
            with metrics.reconcile(c.LORA_KIND):
                out = await reconcile.adapter_round(
                    ctx, name, spec, current, meta.get("generation"), server, server_pods.get(key, []), retry
                )
        except (ApiException, KeyError) as exc:  # the admin token Secret cannot be read
            message = f"cannot read the admin token of BaseModelServer {key[1]!r}: {exc}"
            out = reconcile.RoundOutcome(
                st.pending_status(message, current, meta.get("generation"), reconcile.now_iso()), c.BACKOFF_MAX_S / 10
            )
        diff = st.status_patch(current, out.status, st.ADAPTER_STATUS_KEYS)
        if diff:
            try:
                await kube.patch_status(ctx.api, c.LORA_KIND, namespace, name, diff)
            except ApiException as exc:  # gone meanwhile, or the API server is busy: next round
                logger.warning(f"status not written: {exc.status} {exc.reason}")
            else:
                _report(body, current.get("phase"), out.status, logger)
                if int(out.status.get("attempts") or 0) > int(current.get("attempts") or 0):
                    metrics.RETRIES.labels(c.LORA_KIND).inc()  # a transient failure: another try after backoff
                current = {k: v for k, v in {**current, **diff}.items() if v is not None}
        metrics.ADAPTERS.set(namespace, name, current.get("phase"))
        await _sleep(wake, stopped, out.delay_s)
    metrics.ADAPTERS.set(namespace, name, None)  # deleted, or this operator stops


def _report(body: kopf.Body, before: str | None, status: dict, logger: kopf.Logger) -> None:
    phase = status.get("phase")
    if phase == before:
        return
    message = str(status.get("message") or "")
    logger.info(f"phase {before} -> {phase}: {message}")
    if phase in (c.PHASE_FAILED, c.PHASE_DEGRADED):
        kopf.warn(body, reason=str(phase), message=message)
    else:
        kopf.info(body, reason=str(phase), message=message)


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, delay_s: float) -> None:
    waits = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


@kopf.on.update(*LORA, field="spec")
async def adapter_changed(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """The daemon sees the new generation and runs a forced round now instead of at its next tick."""
    _ctx(memo).wakeup(namespace or "", name).set()


@kopf.on.event(*LORA)
async def adapter_retry_asked(
    event: kopf.RawEvent,
    name: str,
    namespace: str | None,
    meta: kopf.Meta,
    status: kopf.Status,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A new loraplane.dev/retry value wakes the daemon for a forced round now. A raw event handler: kopf's
    diffs leave out every annotation under its storage prefix (loraplane.dev), so no on.update sees it."""
    retry = (meta.get("annotations") or {}).get(c.RETRY_ANNOTATION)
    if event["type"] != "DELETED" and retry is not None and retry != status.get("observedRetry"):
        _ctx(memo).wakeup(namespace or "", name).set()


@kopf.on.delete(*LORA)  # type: ignore[arg-type]  # index kwargs are not in kopf's protocols
async def unload_adapter(
    body: kopf.Body,
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    memo: kopf.Memo,
    retry: int,
    servers: kopf.Index,
    server_pods: kopf.Index,
    **_: Any,
) -> None:
    """Finalizer: DELETE /v1/adapters/{id} on every pod; gone pods and unknown adapters are fine."""
    ctx, namespace = _ctx(memo), namespace or ""
    ctx.wakeups.pop((namespace, name), None)
    key = (namespace, spec.get("baseModelServer"))
    server: ServerRef | None = _first(servers, key)
    if server is None:
        return  # no server, no pods to unload from
    want = st.adapter_want(name, spec)
    try:
        errors = await reconcile.unload_everywhere(ctx, server, server_pods.get(key, []), want.adapter_id)
    except (ApiException, KeyError) as exc:
        errors = [f"cannot read the admin token: {exc}"]
    if errors and retry < c.UNLOAD_RETRIES:
        raise kopf.TemporaryError("; ".join(errors)[:1000], delay=5 * (retry + 1))
    if errors:
        kopf.warn(body, reason="UnloadIncomplete", message="; ".join(errors)[:1000])


# server pods
@kopf.on.event("v1", "pods", labels=SERVER_PODS)  # type: ignore[arg-type]  # index kwargs are not in kopf's protocols
async def server_pod_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    servers: kopf.Index,
    adapters: kopf.Index,
    server_pods: kopf.Index,
    **_: Any,
) -> None:
    """A gated server's starting pod gets its warmer (warmer.py: prewarmed before it turns Ready). A pod that
    turns Ready (new, or after a restart) without one gets every adapter of its server again."""
    ctx, info = _ctx(memo), pod_info(body)
    if info is None:
        return
    key = (info.namespace, info.server)
    server: ServerRef | None = _first(servers, key)
    previous = ctx.pod_marks.get(info.uid)
    mark = (info.is_ready, info.restarts)
    if event["type"] == "DELETED":
        ctx.pod_marks.pop(info.uid, None)
        ctx.drop_warmer(info.uid)
    else:
        ctx.pod_marks[info.uid] = mark
    if info.is_ready:
        ctx.warming.pop(info.uid, None)  # placement counts it as Ready now
    if server is not None and server.is_gated and is_starting(info) and event["type"] != "DELETED":
        if warmer.ensure_warmer(ctx, server, info, _warm_inputs(ctx, key, adapters, server_pods)):
            logger.info(f"pod {info.name} starting: prewarmed before it turns Ready")
    if server is None or previous == mark or event["type"] is None:
        return  # nothing changed, or the initial listing (the adapter daemons converge on their own)
    entries: list[tuple[str, st.AdapterWant]] = list(adapters.get(key, []))
    restarted = previous is not None and info.restarts > previous[1]
    if info.is_ready and (restarted or previous is None or not previous[0]):
        if ctx.warmed.get(info.uid) == info.restarts:
            logger.info(f"pod {info.name} ready, prewarmed behind its gate")
        else:
            await _prewarm_ready_pod(ctx, server, info, [w for _, w in entries], body, logger)
    elif not info.is_ready and info.ip:
        ctx.forget_pod(info.admin_url(server.port))
    _wake(ctx, info.namespace, entries)  # let their status follow the pod set now


async def _prewarm_ready_pod(
    ctx: OperatorContext,
    server: ServerRef,
    info: PodInfo,
    wants: list[st.AdapterWant],
    body: kopf.Body,
    logger: kopf.Logger,
) -> None:
    ctx.forget_pod(info.admin_url(server.port))
    errors = await reconcile.prewarm_pod(ctx, server, info, wants)
    logger.info(f"pod {info.name} ready: {len(wants)} adapters sent, {len(errors)} failed")
    if errors:
        kopf.warn(body, reason="PrewarmFailed", message="; ".join(errors)[:1000])


def _warm_inputs(
    ctx: OperatorContext, key: tuple[str, str], adapters: kopf.Index, server_pods: kopf.Index
) -> warmer.WarmInputs:
    """The warmer's live views of the indexes for one server."""

    return warmer.WarmInputs(
        wants=lambda: [w for _, w in adapters.get(key, [])],
        pods=lambda: list(server_pods.get(key, [])),
        wake=lambda: _wake(ctx, key[0], adapters.get(key, [])),
    )


def _wake(ctx: OperatorContext, namespace: str, entries: Iterable[tuple[str, st.AdapterWant]]) -> None:
    """Run these adapters' rounds now (their daemons wait on the wakeup)."""
    for adapter_name, _want in entries:
        ctx.wakeup(namespace, adapter_name).set()
