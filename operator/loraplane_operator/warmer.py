"""The prewarm gate: no cold pod in rotation.

A gated server pod (`--prewarm-timeout`, from spec.prewarmGate) that has loaded its model answers /ready with 503
"prewarming", so Kubernetes keeps it out of the Service's endpoints, the router keeps it out of its pool and a
rolling update does not count it available. Its warmer (one task per pod run, started by the pod events):

1. polls /ready until the model is loaded;
2. counts the pod as warming (adapter rounds then place adapters on it as on a Ready pod), registers and
   prewarms every adapter of the server on it, and wakes their rounds (which prewarm the ones placed on it by
   ranking);
3. polls the pod's rows until every adapter placed on it is resident at its tier or warmer (a failed load does
   not count: its LoRAAdapter says why), then opens the gate (POST /v1/prewarm/complete): the pod turns Ready.

The server opens its gate itself after the timeout, so an adapter that never loads, or an operator that is
down, cannot hold a pod out for longer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from kubernetes_asyncio.client.exceptions import ApiException

from loraplane_operator import adapter_status as st
from loraplane_operator import constants as c
from loraplane_operator import reconcile
from loraplane_operator.admin_client import AdminClient, AdminError
from loraplane_operator.context import OperatorContext
from loraplane_operator.server_status import PodInfo, ServerRef, ready_pods

log = logging.getLogger("loraplane.operator.warmer")

WAKE_EVERY = 5  # polls between wake-ups of the adapter rounds while some placed adapter is still missing


@dataclass(frozen=True)
class WarmInputs:
    """Live views of the operator's indexes, read on every poll."""

    wants: Callable[[], list[st.AdapterWant]]  # the server's adapters (not Failed, not being deleted)
    pods: Callable[[], list[PodInfo]]  # the server's pods
    wake: Callable[[], None]  # run the server's adapter rounds now


async def read_phase(ctx: OperatorContext, url: str) -> str | None:
    """The server's phase from its /ready (loading, prewarming, ready, draining, failed); None if it does not
    answer (not listening yet)."""
    try:
        response = await ctx.http.get(url + "/ready", timeout=c.READY_TIMEOUT_S)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    phase = body.get("status") if isinstance(body, dict) else None
    return str(phase) if phase else None


async def wait_loaded(ctx: OperatorContext, url: str) -> str:
    """Poll /ready until the model is loaded: "prewarming", or the phase that ends the wait (ready: no gate or
    opened already; draining; failed)."""
    while True:
        phase = await read_phase(ctx, url)
        if phase in ("prewarming", "ready", "draining", "failed"):
            return phase
        await asyncio.sleep(c.WARM_POLL_S)


async def warm_pod(ctx: OperatorContext, server: ServerRef, pod: PodInfo, inputs: WarmInputs) -> str:
    """One pod run's gate, as the module says; how it ended: "opened" (by us), or the phase that ended it."""
    url = pod.url(server.port)  # /ready, as the kubelet probes it
    phase = await wait_loaded(ctx, url)
    if phase != "prewarming":
        return phase
    ctx.warming[pod.uid] = pod
    try:
        await _send(ctx, server, pod, inputs)
        polls = 0
        while True:
            admin = await _admin(ctx, server, pod)
            pending = None if admin is None else await _pending(admin, pod, ctx, inputs)
            if admin is not None and pending == [] and await _open(admin, pod):
                # still warming for placement until Kubernetes sees it Ready (the kubelet's next probe; the pod
                # event ends it sooner), so that no round in between places its adapters elsewhere
                await asyncio.sleep(c.READY_AFTER_GATE_S)
                return "opened"
            now = await read_phase(ctx, url)
            if now not in ("prewarming", None):
                log.info("pod %s: %s before its prewarm finished (waiting for %s)", pod.name, now, pending)
                return str(now)
            polls += 1
            if polls % WAKE_EVERY == 0:
                inputs.wake()
            await asyncio.sleep(c.WARM_POLL_S)
    finally:
        ctx.warming.pop(pod.uid, None)


async def _send(ctx: OperatorContext, server: ServerRef, pod: PodInfo, inputs: WarmInputs) -> None:
    """Register and prewarm the server's adapters on the pod, then wake their rounds (which place the rest)."""
    errors = await reconcile.prewarm_pod(ctx, server, pod, inputs.wants())
    ctx.warmed[pod.uid] = pod.restarts
    if errors:
        log.warning("pod %s: %d adapters not sent: %s", pod.name, len(errors), "; ".join(errors)[:500])
    inputs.wake()


async def _admin(ctx: OperatorContext, server: ServerRef, pod: PodInfo) -> AdminClient | None:
    """The pod's admin client, None while the admin token cannot be read (the next poll tries again)."""
    try:
        token = await reconcile.server_token(ctx, server)
    except (ApiException, KeyError) as exc:
        log.info("pod %s: cannot read the admin token yet: %s", pod.name, exc)
        return None
    return AdminClient(ctx.http, pod.admin_url(server.port), token)


async def _open(admin: AdminClient, pod: PodInfo) -> bool:
    try:
        opened = await admin.prewarm_complete()
    except AdminError as exc:  # draining or unreachable now: the phase read after says which
        log.info("pod %s: the gate did not open: %s", pod.name, exc.message)
        return False
    log.info("pod %s prewarmed: gate %s", pod.name, "opened" if opened else "was open")
    return True


async def _pending(admin: AdminClient, pod: PodInfo, ctx: OperatorContext, inputs: WarmInputs) -> list[str] | None:
    """The adapters placed on the pod that it does not hold yet; None when its rows cannot be read now."""
    try:
        rows = {str(r["id"]): r for r in await admin.list_adapters()}
    except AdminError:
        return None
    live = ready_pods(inputs.pods(), ctx.warming_pods(pod.namespace, pod.server))
    return st.prewarm_pending(pod.name, [p.name for p in live], inputs.wants(), rows)


def ensure_warmer(ctx: OperatorContext, server: ServerRef, pod: PodInfo, inputs: WarmInputs) -> bool:
    """Start the warmer of this pod run (uid and restart count) unless one ran or runs for it; a restarted pod's
    old warmer is cancelled. True when one was started."""
    entry = ctx.warmers.get(pod.uid)
    if entry is not None and entry[0] == pod.restarts:
        return False
    if entry is not None:
        entry[1].cancel()
    task = asyncio.create_task(_run(ctx, server, pod, inputs), name=f"warmer {pod.namespace}/{pod.name}")
    ctx.warmers[pod.uid] = (pod.restarts, task)
    return True


async def _run(ctx: OperatorContext, server: ServerRef, pod: PodInfo, inputs: WarmInputs) -> None:
    try:
        await warm_pod(ctx, server, pod, inputs)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a warmer must never take the operator down; the server's timeout opens it
        log.exception("pod %s: the prewarm gate's warmer failed; the server opens its gate after its timeout", pod.name)
