"""The operator's entry point: kopf settings, the shared context, and `run_operator`."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from loraplane_operator import constants as c
from loraplane_operator import handlers, kube
from loraplane_operator.admin_client import make_http_client
from loraplane_operator.context import OperatorContext

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
    memo["ctx"] = OperatorContext(api=await kube.make_api_client(), http=make_http_client())


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
) -> None:
    """Run the operator until SIGTERM/SIGINT: watch one namespace, or the whole cluster when None.

    standalone: no kopf peering (run one replica, Deployment strategy Recreate). liveness_endpoint:
    e.g. "http://0.0.0.0:8080/healthz" for a livenessProbe. Credentials: in-cluster service account,
    else $KUBECONFIG / ~/.kube/config.
    """
    kopf.configure(verbose=verbose)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin call otherwise
    kopf.run(
        standalone=standalone,
        clusterwide=namespace is None,
        namespaces=[namespace] if namespace else [],
        liveness_endpoint=liveness_endpoint,
        memo=kopf.Memo(),
    )
