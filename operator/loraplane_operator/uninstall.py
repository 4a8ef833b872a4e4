"""The chart's pre-delete hook: delete a release's LoRAAdapters, then its BaseModelServers, and wait until
they are gone, while the operator still runs to unload the adapters and remove its finalizers.

    python -m loraplane_operator.uninstall --namespace NS --selector app.kubernetes.io/instance=REL [--timeout 120]

Exits 1 (and the uninstall stops, with the names) if something is still there after the timeout: usually
the operator is not running; start it again, or remove the finalizer `loraplane.dev/finalizer` by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from loraplane_operator import constants as c
from loraplane_operator import kube

POLL_S = 1.0
# adapters first: their finalizer unloads them from server pods that are still alive
ORDER = (c.LORA_PLURAL, c.BMS_PLURAL)


async def list_names(api: client.CustomObjectsApi, namespace: str, plural: str, selector: str) -> list[str]:
    """Names of the matching objects; none when the CRD itself is gone (deleted by hand before uninstalling)."""
    try:
        listing = await api.list_namespaced_custom_object(
            c.GROUP, c.VERSION, namespace, plural, label_selector=selector
        )
    except ApiException as exc:
        if exc.status == 404:
            return []
        raise
    return sorted(item["metadata"]["name"] for item in listing["items"])


async def delete_all(api: client.CustomObjectsApi, namespace: str, plural: str, names: list[str]) -> None:
    for name in names:
        try:
            await api.delete_namespaced_custom_object(c.GROUP, c.VERSION, namespace, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise


async def delete_and_wait(namespace: str, selector: str, timeout_s: float) -> list[str]:
    """Deletes each kind in ORDER and waits for it to be gone; returns what is left ("plural/name")."""
    api_client = await kube.make_api_client()
    deadline = time.monotonic() + timeout_s
    try:
        api = client.CustomObjectsApi(api_client)
        for plural in ORDER:
            names = await list_names(api, namespace, plural, selector)
            print(f"deleting {len(names)} {plural} in {namespace}: {', '.join(names) or '-'}", flush=True)
            await delete_all(api, namespace, plural, names)
            started = time.monotonic()
            while names and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
                names = await list_names(api, namespace, plural, selector)
            if names:
                return [f"{plural}/{name}" for name in names]
            print(f"{plural} gone after {time.monotonic() - started:.1f} s", flush=True)
        return []
    finally:
        await api_client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--selector", required=True, help="label selector of the release's resources")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds, for all kinds together")
    args = parser.parse_args(argv)
    left = asyncio.run(delete_and_wait(args.namespace, args.selector, args.timeout))
    if left:
        print(
            f"still there after {args.timeout:.0f} s (is the operator running?): {', '.join(left)}; "
            f"start the operator and uninstall again, or remove the finalizer {c.FINALIZER} by hand",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
