"""The process kubelet: a fake GPU node whose pods run as local processes, each on its own 127.x.y.z.

It also plays the scheduler: pods without a node are bound to this node when they fit; and a local-path
provisioner: a pending claim of such a pod gets a hostPath PersistentVolume under the kubelet's root.

    python -m e2e.kubelet --kubeconfig admin.kubeconfig [--node-name N] [--root DIR] [--pod-subnet 127.a.b]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from e2e.api import ApiClient, ApiError, write_kubeconfig
from e2e.container_env import build_env
from e2e.node import NodeConfig, lease_manifest, lease_renewal, node_manifest, node_status, unfit_reason
from e2e.pod_runtime import PodRuntime, parse_entrypoint
from e2e.process import signal_group
from e2e.volumes import claims_unfit_reason, reclaim_released, volume_dirs

log = logging.getLogger("kubelet")
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 60.0
SHUTDOWN_GRACE_SECONDS = 10.0


class ProcessKubelet:
    """Node registration and heartbeat, a pod watch, and a sync loop that runs in the calling thread."""

    def __init__(
        self,
        api: ApiClient,
        node: NodeConfig,
        root: Path,
        pod_subnet: str,
        entrypoints: dict[str, list[str]] | None = None,
        kubelet_version: str = "v1.34.4",
    ) -> None:
        self.api = api
        self.node = node
        self.root = root.absolute()  # PersistentVolume host paths must be absolute
        self.entrypoints = entrypoints or {}
        self.kubelet_version = kubelet_version
        self._free_ips = [f"{pod_subnet}.{x}" for x in range(2, 255)]
        self._pods: dict[str, dict[str, Any]] = {}  # uid -> latest object from the watch
        self._pods_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._runtimes: dict[str, PodRuntime] = {}
        self._reported: dict[str, dict[str, Any]] = {}  # uid -> last status written
        self._unschedulable: dict[str, str] = {}  # uid -> the reason last written to PodScheduled
        self._finalizing: set[str] = set()

    def run(self) -> None:
        """Registers the node, then syncs pods until `stop()`; stops every pod process on the way out."""
        self._register()
        for target in (self._watch_pods, self._heartbeat):
            threading.Thread(target=target, name=target.__name__, daemon=True).start()
        try:
            while not self._stopping.is_set():
                self._wake.wait(0.5)
                self._wake.clear()
                try:
                    self._sync()
                except Exception:
                    log.exception("sync failed")
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    # node

    def _register(self) -> None:
        manifest = node_manifest(self.node, self.kubelet_version)
        try:
            self.api.create("/api/v1/nodes", manifest)
        except ApiError as error:
            if error.status != 409:
                raise
        node = self.api.merge_patch(f"/api/v1/nodes/{self.node.name}/status", {"status": manifest["status"]})
        try:
            self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease_manifest(node))
        except ApiError as error:
            if error.status != 409:
                raise
        log.info("registered node %s", self.node.name)

    def _heartbeat(self) -> None:
        lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node.name}"
        last_status = time.monotonic()
        while not self._stopping.wait(LEASE_RENEW_SECONDS):
            try:
                self.api.merge_patch(lease, lease_renewal())
                for name in reclaim_released(self.api, self.node.name, self.root):
                    log.info("deleted released volume %s", name)
                if time.monotonic() - last_status >= NODE_STATUS_SECONDS:
                    status = node_status(self.node, self.kubelet_version)
                    self.api.merge_patch(f"/api/v1/nodes/{self.node.name}/status", {"status": status})
                    last_status = time.monotonic()
            except Exception:
                log.exception("heartbeat failed")

    # pods from the API

    def _watch_pods(self) -> None:
        while not self._stopping.is_set():
            try:
                listing = self.api.get("/api/v1/pods")
                with self._pods_lock:
                    self._pods = {p["metadata"]["uid"]: p for p in listing["items"]}
                self._wake.set()
                version = listing["metadata"]["resourceVersion"]
                for event in self.api.watch("/api/v1/pods", version):
                    if event["type"] == "ERROR":
                        break  # e.g. 410 Gone: list again
                    pod = event["object"]
                    if event["type"] != "BOOKMARK":
                        with self._pods_lock:
                            if event["type"] == "DELETED":
                                self._pods.pop(pod["metadata"]["uid"], None)
                            else:
                                self._pods[pod["metadata"]["uid"]] = pod
                        self._wake.set()
            except Exception as error:
                log.warning("pod watch: %s", error)
                self._stopping.wait(1.0)

    # sync

    def _sync(self) -> None:
        with self._pods_lock:
            pods = dict(self._pods)
        self._unschedulable = {uid: why for uid, why in self._unschedulable.items() if uid in pods}
        self._finalizing &= pods.keys()
        for uid, runtime in list(self._runtimes.items()):
            if uid not in pods:  # gone from the API (deleted with grace 0, or by us)
                if not runtime.is_terminating:
                    self._terminate(runtime, None)
                if runtime.is_stopped:
                    self._forget(uid)
        on_node = [p for p in pods.values() if p["spec"].get("nodeName") == self.node.name and not _is_done(p)]
        for pod in pods.values():
            node_name = pod["spec"].get("nodeName")
            try:
                if not node_name and not pod["metadata"].get("deletionTimestamp"):
                    self._schedule(pod, on_node)
                elif node_name == self.node.name:
                    self._sync_pod(pod)
            except Exception:
                log.exception("syncing %s/%s", pod["metadata"]["namespace"], pod["metadata"]["name"])

    def _schedule(self, pod: dict[str, Any], on_node: list[dict[str, Any]]) -> None:
        meta = pod["metadata"]
        if pod["spec"].get("schedulerName", "default-scheduler") != "default-scheduler":
            return
        reason = unfit_reason(self.node, pod, on_node) or claims_unfit_reason(self.api, pod, self.node.name, self.root)
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        try:
            if reason is None:
                target = {"apiVersion": "v1", "kind": "Node", "name": self.node.name}
                binding = {"apiVersion": "v1", "kind": "Binding", "target": target}
                binding["metadata"] = {"name": meta["name"], "uid": meta["uid"]}  # uid: a precondition
                self.api.create(f"{path}/binding", binding)
                on_node.append({**pod, "spec": {**pod["spec"], "nodeName": self.node.name}})
                log.info("bound %s/%s", meta["namespace"], meta["name"])
            elif self._unschedulable.get(meta["uid"]) != reason:
                condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": reason}
                self.api.merge_patch(f"{path}/status", {"status": {"conditions": [condition]}})
                self._unschedulable[meta["uid"]] = reason
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    def _sync_pod(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        runtime = self._runtimes.get(uid)
        if pod["metadata"].get("deletionTimestamp"):
            if runtime is None and uid not in self._finalizing:
                self._finalizing.add(uid)
                threading.Thread(target=self._finalize, args=(pod,), daemon=True).start()
            elif runtime is not None and not runtime.is_terminating:
                self._terminate(runtime, pod)
            return
        if runtime is None:
            if _is_done(pod) or not self._free_ips:
                return
            meta = pod["metadata"]
            directory = self.root / "pods" / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
            runtime = self._runtimes[uid] = PodRuntime(pod, self._free_ips.pop(0), directory, self.entrypoints)
            log.info("starting %s/%s on %s", meta["namespace"], meta["name"], runtime.pod_ip)
        if runtime.is_terminating:
            return
        runtime.sync(pod, self._container_env, lambda pod: volume_dirs(self.api, pod, runtime.dir))
        self._report(runtime)

    def _report(self, runtime: PodRuntime) -> None:
        status = runtime.status()
        if status == self._reported.get(runtime.uid):
            return
        try:
            self.api.merge_patch(f"{_pod_path(runtime.pod)}/status", {"status": status})
            self._reported[runtime.uid] = status
        except ApiError as error:
            if error.status != 404:
                raise

    def _terminate(self, runtime: PodRuntime, pod: dict[str, Any] | None) -> None:
        runtime.is_terminating = True
        threading.Thread(target=self._stop_and_finalize, args=(runtime, pod), daemon=True).start()

    def _stop_and_finalize(self, runtime: PodRuntime, pod: dict[str, Any] | None) -> None:
        grace = 0.0
        if pod is not None:
            default = pod["spec"].get("terminationGracePeriodSeconds", 30)
            grace = pod["metadata"].get("deletionGracePeriodSeconds", default)
        runtime.stop(float(grace))
        log.info("stopped %s/%s", runtime.pod["metadata"]["namespace"], runtime.pod["metadata"]["name"])
        if pod is not None:
            self._finalize(pod)

    def _finalize(self, pod: dict[str, Any]) -> None:
        """The kubelet's last word on a deleted pod: remove it for good once its processes are gone."""
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
        body["preconditions"] = {"uid": meta["uid"]}
        try:
            self.api.delete(_pod_path(pod), body)
        except ApiError as error:
            if error.status not in (404, 409):
                log.warning("finalizing %s/%s: %s", meta["namespace"], meta["name"], error)
        except Exception as error:
            log.warning("finalizing %s/%s: %s", meta["namespace"], meta["name"], error)

    def _forget(self, uid: str) -> None:
        runtime = self._runtimes.pop(uid)
        self._free_ips.append(runtime.pod_ip)
        self._reported.pop(uid, None)
        self._finalizing.discard(uid)

    def _shutdown(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        runtimes = list(self._runtimes.values())
        for runtime in runtimes:
            for container in runtime.all_containers:
                if container.process is not None:
                    signal_group(container.process, signal.SIGTERM)
        for runtime in runtimes:
            runtime.stop(max(0.0, deadline - time.monotonic()))
        log.info("stopped %d pods", len(runtimes))

    # container environment

    def _container_env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        meta = pod["metadata"]
        server = urlparse(self.api.server)
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(
            HOSTNAME=meta["name"],
            POD_IP=pod["status"]["podIP"],
            POD_NAME=meta["name"],
            POD_NAMESPACE=meta["namespace"],
            KUBERNETES_SERVICE_HOST=server.hostname or "127.0.0.1",
            KUBERNETES_SERVICE_PORT=str(server.port or 443),
        )
        env.pop("KUBECONFIG", None)
        if pod["spec"].get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod))
        return build_env(self.api, pod, container, env)

    def _service_account_kubeconfig(self, pod: dict[str, Any]) -> Path:
        """Stands in for the projected token volume: a kubeconfig with a token bound to the pod."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 86400,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
            },
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        token = self.api.create(path, request)["status"]["token"]
        kubeconfig = self._runtimes[meta["uid"]].dir / "serviceaccount.kubeconfig"
        ca_file = Path(str(self.api.session.verify))
        return write_kubeconfig(kubeconfig, self.api.server, ca_file, token=token, namespace=meta["namespace"])


def _pod_path(pod: dict[str, Any]) -> str:
    return f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"


def _is_done(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def random_pod_subnet() -> str:
    """A random 127.a.b: two kubelets on one machine (two developers) never share pod addresses."""
    return f"127.{random.randint(100, 254)}.{random.randint(0, 255)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", default="loraplane-node-0")
    parser.add_argument("--root", type=Path, default=Path("kubelet"))
    parser.add_argument("--pod-subnet", default=None, help="first three octets of pod IPs, e.g. 127.42.7")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--kubelet-version", default="v1.34.4")
    parser.add_argument(
        "--entrypoint", action="append", default=[], help="IMAGE=COMMAND for containers without a command"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    kubelet = ProcessKubelet(
        ApiClient.from_kubeconfig(args.kubeconfig),
        NodeConfig(name=args.node_name, num_gpus=args.gpus),
        args.root,
        args.pod_subnet or random_pod_subnet(),
        dict(parse_entrypoint(e) for e in args.entrypoint),
        args.kubelet_version,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: kubelet.stop())
    kubelet.run()


if __name__ == "__main__":
    main()
