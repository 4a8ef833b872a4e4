"""The operator's entry point: kopf settings, the shared context, and `run_operator`, alone or as one of several
replicas of which the holder of a coordination.k8s.io Lease runs kopf (leader election)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web
from kubernetes_asyncio.leaderelection.electionconfig import Config as ElectionConfig
from kubernetes_asyncio.leaderelection.leaderelection import LeaderElection
from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

from loraplane_operator import constants as c
from loraplane_operator import handlers, kube, metrics
from loraplane_operator.admin_client import make_http_client
from loraplane_operator.context import OperatorContext
from loraplane_operator.network_builders import Peer

__all__ = ["run_operator", "handlers"]


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Settings (events, persistence in annotations, finalizer, timeouts) and the shared context."""
    settings.posting.level = logging.INFO
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    settings.networking.request_timeout = 60.0
    settings.watching.server_timeout = 300
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]
    peer = memo.get("peer")
    if peer is None:
        logging.getLogger(__name__).warning(
            "the operator's own pods are unknown (--pod-namespace, --pod-labels): no NetworkPolicy guards the "
            "servers' admin port (one would shut this operator out)"
        )
    memo["ctx"] = OperatorContext(api=await kube.make_api_client(), http=make_http_client(), peer=peer)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    ctx = memo.get("ctx")
    if ctx is not None:
        await ctx.close()


def run_operator(
    namespace: str | None = None,
    standalone: bool = True,
    liveness_endpoint: str | None = None,
    verbose: bool = False,
    metrics_port: int | None = None,
    metrics_address: str = "0.0.0.0",
    leader_election: str | None = None,
    identity: str | None = None,
    peer: Peer | None = None,
) -> None:
    """Run the operator until SIGTERM/SIGINT: watch one namespace, or the whole cluster when None.

    standalone: no kopf peering. liveness_endpoint: e.g. "http://0.0.0.0:8080/healthz" for a livenessProbe.
    metrics_port: serve /metrics there, bound to metrics_address. leader_election: "namespace/name" of a Lease;
    every replica campaigns and only its holder runs kopf (the others wait, answering their liveness), so a
    Deployment may run two and roll. identity: this candidate's name in the Lease (default
    `$POD_NAME_<random>`, the host name without POD_NAME). Credentials: in-cluster service account, else
    $KUBECONFIG / ~/.kube/config. peer: the operator's own pods (namespace and labels), which the servers'
    NetworkPolicy lets reach their admin port; None (outside a pod): no NetworkPolicy is made.
    """
    kopf.configure(verbose=verbose)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin call otherwise
    logging.getLogger(__name__).setLevel(logging.INFO)  # leadership changes, whatever kopf's level
    if metrics_port is not None:
        metrics.serve(metrics_port, metrics_address)
    options: dict[str, Any] = {
        "standalone": standalone,
        "clusterwide": namespace is None,
        "namespaces": [namespace] if namespace else [],
        "memo": kopf.Memo(peer=peer),
    }
    if leader_election is None:
        kopf.run(liveness_endpoint=liveness_endpoint, **options)
        return
    lease_namespace, _, lease_name = leader_election.partition("/")
    if not lease_namespace or not lease_name:
        raise ValueError(f"--leader-elect wants NAMESPACE/NAME, got {leader_election!r}")
    # unique per process, as controller-runtime's: a restarted container of the leader's pod must campaign anew,
    # not find its own name on the Lease and take it back before the standby can
    who = identity or f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    sys.exit(asyncio.run(run_elected(lease_namespace, lease_name, who, liveness_endpoint, options)))


async def run_elected(
    lease_namespace: str, lease_name: str, identity: str, liveness_endpoint: str | None, options: dict[str, Any]
) -> int:
    """Campaign for the Lease; while held, run kopf. Returns 0 after SIGTERM/SIGINT, 1 when the Lease was lost
    (the process exits and its pod restarts as a follower: kopf's state is never shared between terms)."""
    done = asyncio.Event()
    state = {"leading": False, "lost": False}
    failure: list[BaseException] = []  # kopf's or the election's own error: re-raised, never a silent exit
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)  # kopf installs its own while it runs, and then returns
    health = await serve_health(liveness_endpoint, state) if liveness_endpoint else None

    async def lead() -> None:
        state["leading"] = True
        logging.getLogger(__name__).info("%s holds the Lease %s/%s: running", identity, lease_namespace, lease_name)
        try:
            await kopf.operator(**options)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the election runs this as a task nobody awaits
            failure.append(exc)
            raise
        finally:
            done.set()

    async def lost() -> None:
        state["lost"] = True
        logging.getLogger(__name__).error("%s lost the Lease %s/%s: exiting", identity, lease_namespace, lease_name)
        done.set()

    api = await kube.make_api_client()
    lock = LeaseLock(lease_name, lease_namespace, identity, api)
    config = ElectionConfig(lock, c.LEASE_DURATION_S, c.LEASE_RENEW_DEADLINE_S, c.LEASE_RETRY_S, lead, lost)
    election = asyncio.create_task(LeaderElection(config).run())
    waiting = asyncio.create_task(done.wait())
    try:
        await asyncio.wait([election, waiting], return_when=asyncio.FIRST_COMPLETED)
        if election.done() and not election.cancelled() and election.exception() is not None:
            failure.append(election.exception())  # type: ignore[arg-type]
    finally:
        for task in (election, waiting):
            task.cancel()
        await asyncio.gather(election, waiting, return_exceptions=True)
        await api.close()
        if health is not None:
            await health.cleanup()
    if failure:
        raise failure[0]
    return 1 if state["lost"] else 0


async def serve_health(endpoint: str, state: dict[str, bool]) -> web.AppRunner:
    """GET <path> answers 200 while this process's event loop runs, leader or not (kopf's own liveness endpoint
    exists only in the leader)."""
    url = urlsplit(endpoint)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": state["leading"]})

    app = web.Application()
    app.router.add_get(url.path or "/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname, url.port or 8080).start()
    return runner
