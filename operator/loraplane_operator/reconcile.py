"""The operator's work behind the thin handlers: apply a server's children, run one LoRAAdapter round
(read residency, prewarm where needed, compute status), prewarm a new pod, unload on delete, read the
model reports of starting server pods."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import httpx
from kubernetes_asyncio.client.exceptions import ApiException

from loraplane_operator import adapter_status as st
from loraplane_operator import builders, kube
from loraplane_operator import constants as c
from loraplane_operator.admin_client import AdminError, PermanentAdminError, RetryableAdminError
from loraplane_operator.context import OperatorContext
from loraplane_operator.engine_client import TRAITS
from loraplane_operator.router_builders import ROUTER_KINDS, router_name
from loraplane_operator.server_status import ModelReport, PodInfo, ServerRef, model_report, ready_pods

AUTOSCALERS = ((c.HPA_API_VERSION, "HorizontalPodAutoscaler"), (c.KEDA_API_VERSION, "ScaledObject"))
# what runs the server pods: a switch between them (vLLM onto several nodes and back) deletes the other
WORKLOADS = (("apps/v1", "Deployment"), (c.LWS_API_VERSION, "LeaderWorkerSet"))
# off by a spec switch (or, the NetworkPolicy, an operator outside the cluster): deleted when not applied
OPTIONAL = (("policy/v1", "PodDisruptionBudget"), ("networking.k8s.io/v1", "NetworkPolicy"))


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def age_s(timestamp: str | None, now: str) -> float | None:
    if not timestamp:
        return None
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    try:
        return (datetime.strptime(now, fmt) - datetime.strptime(timestamp, fmt)).total_seconds()
    except ValueError:
        return None


# BaseModelServer
async def apply_children(ctx: OperatorContext, objs: Sequence[Mapping[str, Any]], namespace: str, name: str) -> None:
    """Apply the model cache's claim (created once), the Deployment, Service, autoscaler, disruption budget and
    router; delete the autoscaler kind, the budget and the router objects the spec no longer asks for. The claim
    is never deleted here (its owner's deletion does)."""
    for obj in objs:
        try:
            if obj["kind"] == "Secret":  # a generated token is never replaced (the pods hold it)
                await kube.create_if_absent(ctx.api, obj)
            elif obj["kind"] == "PersistentVolumeClaim" and await _exists(ctx, obj):
                continue  # a bound claim's spec is immutable; the downloaded models stay
            else:
                await kube.apply(ctx.api, obj)
        except ApiException as exc:
            exc.reason = f"{obj['kind']} ({obj['apiVersion']}): {exc.reason}"
            raise
    applied = {(o["kind"], o["metadata"]["name"]) for o in objs}
    gone = [(v, k, name) for v, k in (*AUTOSCALERS, *WORKLOADS, *OPTIONAL)]
    gone += [(v, k, router_name(name)) for v, k in ROUTER_KINDS]
    for api_version, kind, obj_name in gone:
        if (kind, obj_name) not in applied:
            await kube.delete_if_exists(ctx.api, api_version, kind, namespace, obj_name)


async def _exists(ctx: OperatorContext, obj: Mapping[str, Any]) -> bool:
    meta = obj["metadata"]
    return await kube.get(ctx.api, obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) is not None


async def read_model_report(ctx: OperatorContext, pod: PodInfo, port: int) -> ModelReport | None:
    """GET /ready of a starting pod (no token: /ready is open), None if it does not answer or says nothing."""
    try:
        response = await ctx.http.get(pod.url(port) + "/ready", timeout=c.READY_TIMEOUT_S)
        return model_report(pod.name, response.json())
    except (httpx.HTTPError, ValueError):
        return None


async def model_reports(ctx: OperatorContext, pods: Iterable[PodInfo], port: int) -> list[ModelReport]:
    """The model reports of the pods that have an address but are not ready yet."""
    starting = [p for p in pods if p.ip and not p.is_ready]
    reports = await asyncio.gather(*(read_model_report(ctx, p, port) for p in starting))
    return [r for r in reports if r is not None]


async def current_replicas(ctx: OperatorContext, namespace: str, name: str, spec: Mapping[str, Any]) -> int | None:
    """The live Deployment's (or LeaderWorkerSet's) replicas (what an autoscaler chose), None before it exists."""
    deployment = await kube.get(ctx.api, *builders.workload_kind(spec), namespace, name)
    return None if deployment is None else int((deployment.get("spec") or {}).get("replicas", 1))


async def server_token(ctx: OperatorContext, server: ServerRef) -> str | None:
    if not server.token_secret:
        return None
    key = (server.namespace, server.token_secret, server.token_key)
    return await ctx.tokens.get(
        key, lambda: kube.read_secret_key(ctx.api, server.namespace, server.token_secret or "", server.token_key)
    )


# LoRAAdapter round
@dataclass(frozen=True)
class RoundOutcome:
    status: dict[str, Any]
    delay_s: float  # when the next round should run


async def _read_row(
    ctx: OperatorContext, pod: PodInfo, port: int, token: str | None, adapter_id: str, kind: str
) -> tuple[dict | None, str | None]:
    url = pod.admin_url(port)
    try:
        rows = await ctx.residency.rows(url, ctx.admin(url, token, kind).list_adapters)
    except AdminError as exc:
        return None, exc.message
    return rows.get(adapter_id), None


async def _sync_pod(
    ctx: OperatorContext,
    pod: PodInfo,
    port: int,
    token: str | None,
    want: st.AdapterWant,
    tier: str,
    row: dict | None,
    *,
    exact: bool,
    force: bool,
    can_retry: bool,
    kind: str,
) -> st.PodResult:
    """Register/prewarm on one pod if needed, then move it to the wanted tier if it sits off the goal (any
    other tier while `exact`, else a colder one); the pod's row afterwards (or the call's error, permanent
    for a 4xx refusal)."""
    is_prewarm = st.needs_prewarm(row, tier, force=force, can_retry=can_retry)
    if not is_prewarm and not (can_retry and st.needs_tier_call(row, tier, exact=exact)):
        return st.PodResult(pod.name, tier, row, exact=exact)
    url = pod.admin_url(port)
    admin = ctx.admin(url, token, kind)
    try:
        async with ctx.slot(url):
            if is_prewarm:
                row = await admin.prewarm(want.adapter_id, want.source, tier, want.pinned)
            if st.needs_tier_call(row, tier, exact=exact):
                row = await admin.set_tier(want.adapter_id, st.goal_tier(tier))
    except AdminError as exc:
        permanent = isinstance(exc, PermanentAdminError)
        return st.PodResult(pod.name, tier, row, error=exc.message, attempted=True, permanent=permanent, exact=exact)
    if row is not None:
        ctx.residency.put(url, row)
    return st.PodResult(pod.name, tier, row, attempted=True, exact=exact)


def next_delay(status: Mapping[str, Any]) -> float:
    attempts = int(status.get("attempts") or 0)
    phase = status.get("phase")
    if phase in (c.PHASE_LOADING, c.PHASE_DEGRADED) and 0 < attempts < c.MAX_ATTEMPTS:
        return max(st.backoff_s(attempts), c.LOADING_POLL_S)
    if phase == c.PHASE_LOADING and attempts == 0:
        return c.LOADING_POLL_S
    return c.ADAPTER_RESYNC_S


async def adapter_round(
    ctx: OperatorContext,
    name: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    generation: int | None,
    server: ServerRef | None,
    pods: Iterable[PodInfo],
    retry: str | None = None,
) -> RoundOutcome:
    """One reconcile round of a LoRAAdapter over every Ready pod of its server. A spec change or a new
    `retry` (the retry annotation's value) resets the attempts; a Failed adapter is otherwise only read."""
    now = now_iso()
    want = st.adapter_want(name, spec)
    if server is None:
        message = f"BaseModelServer {spec.get('baseModelServer')!r} not found"
        return RoundOutcome(st.pending_status(message, status, generation, now), c.ADAPTER_RESYNC_S)
    live = ready_pods(pods, ctx.warming_pods(server.namespace, server.name))
    if not live:
        message = f"no Ready pod of BaseModelServer {server.name!r} yet"  # pod events wake the daemon
        return RoundOutcome(st.pending_status(message, status, generation, now), c.ADAPTER_RESYNC_S)
    traits = TRAITS[server.engine]
    refusal = traits.refusal(want.tier, want.pinned, server.engine)
    if refusal is not None:
        return RoundOutcome(st.refused_status(refusal, status, generation, now), c.ADAPTER_RESYNC_S)
    want = replace(want, tier=traits.goal(want.tier))  # vLLM: "loaded", the one state its rows report
    token = await server_token(ctx, server)
    force = status.get("observedGeneration") != generation or retry != status.get("observedRetry")
    exact = status.get("settledGeneration") != generation  # the spec's tier exactly until first reached
    attempts = 0 if force else int(status.get("attempts") or 0)
    last = None if force else status.get("lastAttemptTime")
    stay_failed = not force and status.get("phase") == c.PHASE_FAILED
    can_retry = st.can_retry(attempts, age_s(last, now), is_failed=stay_failed)

    tiers = st.choose_tiers([p.name for p in live], want)
    if not traits.registers_without_loading:  # vLLM: only the chosen pods load it; the router sends it there
        live = [p for p in live if tiers[p.name] != "none"]
    kind = server.engine
    read = await asyncio.gather(*(_read_row(ctx, p, server.port, token, want.adapter_id, kind) for p in live))

    async def sync(pod: PodInfo, row: dict | None, error: str | None) -> st.PodResult:
        tier = tiers[pod.name]
        if error is not None:  # an unreachable pod counts as an attempt only while retries are allowed
            return st.PodResult(pod.name, tier, None, error=error, attempted=can_retry, exact=exact)
        if row is not None and row.get("state") == "failed" and not force and not stay_failed:
            # a background load that failed since the last round: an attempt, counted once, when acted on
            action = st.failed_load_action(row, attempts, can_retry)
            if action != "retry":
                return st.PodResult(pod.name, tier, row, found_failed=action != "wait", exact=exact)
            out = await _sync_pod(
                ctx, pod, server.port, token, want, tier, row, exact=exact, force=force, can_retry=True, kind=kind
            )
            return replace(out, found_failed=True)
        return await _sync_pod(
            ctx, pod, server.port, token, want, tier, row, exact=exact, force=force, can_retry=can_retry, kind=kind
        )

    results = await asyncio.gather(*(sync(p, row, err) for p, (row, err) in zip(live, read, strict=True)))
    retried = any(r.is_failed_attempt for r in results)
    summary = st.summarize(results, want, attempts)
    has_failure = summary.has_failure or any(r.found_failed for r in results)  # re-sent: loading again
    if not stay_failed:
        attempts = st.next_attempts(attempts, has_failure, retried, summary.is_loading)
    new = st.adapter_status(
        results,
        want,
        status,
        name=name,
        attempts=attempts,
        last_attempt=now if retried else last,
        generation=generation,
        now=now,
        retry=retry,
        stay_failed=stay_failed,
        namespace=server.namespace,
    )
    return RoundOutcome(new, next_delay(new))


# pods
async def prewarm_pod(
    ctx: OperatorContext, server: ServerRef, pod: PodInfo, wants: Iterable[st.AdapterWant]
) -> list[str]:
    """Register every adapter of the server on a new or restarted pod, prewarming those meant for all pods
    (adapters prewarmed on N pods are only registered; their own round picks the pods). Errors returned, an
    unreadable admin token among them (the adapters' rounds send them later)."""
    url = pod.admin_url(server.port)
    ctx.residency.drop(url)
    try:
        token = await server_token(ctx, server)
    except (ApiException, KeyError) as exc:
        return [f"cannot read the admin token: {exc}"]
    admin = ctx.admin(url, token, server.engine)
    traits = TRAITS[server.engine]

    async def one(want: st.AdapterWant) -> str | None:
        tier = traits.goal(want.tier) if want.replicas is None else "none"
        if traits.refusal(want.tier, want.pinned, server.engine) is not None:
            return None  # its own round reports it Failed
        if tier == "none" and not traits.registers_without_loading:
            return None  # vLLM loads it on the pods its round chooses
        try:
            async with ctx.slot(url):
                await admin.prewarm(want.adapter_id, want.source, tier, want.pinned)
        except AdminError as exc:
            return f"{want.adapter_id}: {exc.message}"
        return None

    errors = await asyncio.gather(*(one(w) for w in wants))
    return [e for e in errors if e]


# delete
async def unload_everywhere(
    ctx: OperatorContext, server: ServerRef, pods: Iterable[PodInfo], adapter_id: str
) -> list[str]:
    """DELETE the adapter on every pod with an IP; pods that are gone or never knew it are fine.
    Returns the retryable errors (pod busy with the adapter's requests, 5xx) of pods still Ready."""
    token = await server_token(ctx, server)

    async def one(pod: PodInfo) -> str | None:
        url = pod.admin_url(server.port)
        try:
            async with ctx.slot(url):
                await ctx.admin(url, token, server.engine).unload(adapter_id)
        except RetryableAdminError as exc:
            return f"{pod.name}: {exc.message}" if pod.is_ready and exc.status is not None else None
        except AdminError:
            return None  # refused for good (e.g. bad token): nothing the finalizer can wait for
        finally:
            ctx.residency.drop(url, adapter_id)
        return None

    live = [p for p in pods if p.ip]
    errors = await asyncio.gather(*(one(p) for p in live))
    return [e for e in errors if e]
