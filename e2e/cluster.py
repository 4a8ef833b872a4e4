"""A real Kubernetes control plane on loopback: etcd, kube-apiserver (RBAC on, API aggregation configured, an
audit log of the requests of every ServiceAccount outside kube-system), kube-controller-manager (HPA included,
on a short sync period)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import requests

from e2e.api import ApiClient, ApiError, http_get, write_kubeconfig
from e2e.pki import Pki
from e2e.process import spawn, stop

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Cloud and node-IPAM controllers need a cloud or pod CIDRs; the rest of the default set runs.
CONTROLLERS = "*,-node-ipam-controller,-cloud-node-lifecycle-controller,-node-route-controller,-service-lb-controller"
HPA_SYNC_PERIOD = "5s"  # the default 15s makes autoscaling tests slow
# the kube-aggregator authenticates to extension API servers with this client cert (front-proxy CA)
FRONT_PROXY_CLIENT = "front-proxy-client"
# who did what, for the least-privilege check (e2e/test_rbac_audit.py): one line per request of a ServiceAccount
# outside kube-system (the operator's, the routers'), none for the control plane's own controllers or the nodes
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalCluster:
    """Context manager: starts the control plane in a temp dir and stops every process on exit.

    `kubeconfig` is an admin (system:masters) kubeconfig; `api` an ApiClient for it.
    Set LORAPLANE_E2E_KEEP=1 to keep the temp dir (logs, certs, etcd data) after exit.
    """

    def __init__(self, bin_dir: Path, startup_timeout: float = 180.0) -> None:
        self.bin_dir = bin_dir
        self.startup_timeout = startup_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="loraplane-e2e-"))
        self.log_dir = self.dir / "logs"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.pki = Pki(self.dir / "pki")
        # A CA of its own: any cert it signs may assert a user in X-Remote-User headers.
        self.front_proxy_pki = Pki(self.dir / "front-proxy-pki", ca_name="loraplane-e2e-front-proxy-ca")
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.audit_log = self.dir / "audit.log"  # JSON lines (AUDIT_POLICY)
        self.api: ApiClient | None = None
        self.kubelet_root: Path | None = None
        self.node_name: str | None = None

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # lifecycle

    def start(self) -> None:
        etcd_url = self._start_etcd()
        admin_cert = self.pki.client_cert("admin", "loraplane-admin", ["system:masters"])
        write_kubeconfig(self.kubeconfig, self.server, self.pki.ca_file, cert=admin_cert)
        self.api = ApiClient.from_kubeconfig(self.kubeconfig)
        sa_key, sa_pub = self.pki.service_account_key()
        self._start_apiserver(etcd_url, sa_key, sa_pub)
        self._start_controller_manager(sa_key)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            stop(self.processes.pop(name), grace_seconds=30.0 if name == "kubelet" else 10.0)
        if os.environ.get("LORAPLANE_E2E_KEEP") == "1":
            print(f"loraplane e2e: kept {self.dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def start_kubelet(
        self,
        node_name: str = "loraplane-node-0",
        pod_subnet: str | None = None,
        entrypoints: dict[str, str] | None = None,
    ) -> Path:
        """Run the process kubelet (e2e/kubelet.py) as a child process; returns its root dir.

        `entrypoints` maps an image (without tag) to the command its containers run when they set none.
        """
        root = self.dir / "kubelet"
        argv = [sys.executable, "-m", "e2e.kubelet", "--kubeconfig", str(self.kubeconfig)]
        argv += ["--node-name", node_name, "--root", str(root)]
        argv += ["--pod-subnet", pod_subnet] if pod_subnet else []
        for image, command in (entrypoints or {}).items():
            argv += ["--entrypoint", f"{image}={command}"]
        self._spawn("kubelet", argv, cwd=REPO_ROOT)
        self._wait("the kubelet's node to be Ready", "kubelet", lambda: _is_node_ready(self._admin(), node_name))
        self.kubelet_root, self.node_name = root, node_name
        return root

    # service accounts

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: Path | None = None, expiration_seconds: int = 3600
    ) -> Path:
        """A kubeconfig that authenticates as ServiceAccount `namespace/name` (TokenRequest API)."""
        spec = {"expirationSeconds": expiration_seconds}
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        answer = self._admin().create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", request)
        path = path or self.dir / f"sa-{namespace}-{name}.kubeconfig"
        token = answer["status"]["token"]
        return write_kubeconfig(path, self.server, self.pki.ca_file, token=token, namespace=namespace)

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        """What the process kubelet captured from a container (stdout and stderr, all restarts)."""
        assert self.kubelet_root is not None, "the kubelet is not started"
        paths = sorted((self.kubelet_root / "pods").glob(f"{namespace}_{pod}_*/{container}.log"), key=os.path.getmtime)
        return paths[-1].read_text(errors="replace") if paths else ""

    def log_tail(self, component: str, num_lines: int = 40) -> str:
        path = self.log_dir / f"{component}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:]) if path.exists() else ""

    # components

    def _start_etcd(self) -> str:
        client_port, peer_port = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        argv = [str(self.bin_dir / "etcd"), "--name", "e2e", "--data-dir", str(self.dir / "etcd")]
        argv += ["--listen-client-urls", client_url, "--advertise-client-urls", client_url]
        argv += ["--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url]
        argv += ["--initial-cluster", f"e2e={peer_url}", "--unsafe-no-fsync", "--log-level", "warn"]
        self._spawn("etcd", argv)
        self._wait("etcd /health", "etcd", lambda: _http_ok(f"{client_url}/health"))
        return client_url

    def _start_apiserver(self, etcd_url: str, sa_key: Path, sa_pub: Path) -> None:
        dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"]
        dns.append("kubernetes.default.svc.cluster.local")
        cert, key = self.pki.serving_cert("apiserver", dns, ["127.0.0.1", "10.96.0.1"])
        argv = [str(self.bin_dir / "kube-apiserver"), "--etcd-servers", etcd_url]
        argv += ["--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1"]
        argv += ["--secure-port", str(self.api_port), "--cert-dir", str(self.dir / "apiserver-certs")]
        argv += ["--tls-cert-file", str(cert), "--tls-private-key-file", str(key)]
        argv += ["--client-ca-file", str(self.pki.ca_file), "--authorization-mode", "Node,RBAC"]
        argv += ["--service-account-issuer", SERVICE_ACCOUNT_ISSUER, "--service-account-key-file", str(sa_pub)]
        argv += ["--service-account-signing-key-file", str(sa_key), "--service-cluster-ip-range", SERVICE_CIDR]
        # A loopback address may not be an Endpoints address, so the `kubernetes` Service gets none.
        argv += ["--endpoint-reconciler-type", "none", "--allow-privileged=true", "--profiling=false", "-v", "1"]
        policy = self.dir / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        argv += ["--audit-policy-file", str(policy), "--audit-log-path", str(self.audit_log)]
        argv += ["--audit-log-format", "json", "--audit-log-mode", "blocking", "--audit-log-maxsize", "0"]
        argv += self._aggregator_flags()
        self._spawn("kube-apiserver", argv)
        self._wait("kube-apiserver /readyz", "kube-apiserver", lambda: self._admin().get_raw("/readyz") == "ok")

    def _aggregator_flags(self) -> list[str]:
        """API aggregation (APIService): the proxy's client cert and the request-header authentication that
        extension servers trust. No --enable-aggregator-routing: the ClusterIP resolver is the one that also
        routes to ExternalName Services, and loopback pod IPs can never be Endpoints here."""
        proxy_cert, proxy_key = self.front_proxy_pki.client_cert(FRONT_PROXY_CLIENT, FRONT_PROXY_CLIENT, [])
        argv = ["--requestheader-client-ca-file", str(self.front_proxy_pki.ca_file)]
        argv += ["--requestheader-allowed-names", FRONT_PROXY_CLIENT]
        argv += ["--requestheader-username-headers", "X-Remote-User", "--requestheader-group-headers", "X-Remote-Group"]
        argv += ["--requestheader-extra-headers-prefix", "X-Remote-Extra-"]
        return argv + ["--proxy-client-cert-file", str(proxy_cert), "--proxy-client-key-file", str(proxy_key)]

    def _start_controller_manager(self, sa_key: Path) -> None:
        cert = self.pki.client_cert("kube-controller-manager", "system:kube-controller-manager", [])
        kubeconfig = write_kubeconfig(self.dir / "kcm.kubeconfig", self.server, self.pki.ca_file, cert=cert)
        argv = [str(self.bin_dir / "kube-controller-manager"), "--kubeconfig", str(kubeconfig)]
        argv += ["--authentication-kubeconfig", str(kubeconfig), "--authorization-kubeconfig", str(kubeconfig)]
        argv += ["--secure-port", "0", "--leader-elect=false", "--controllers", CONTROLLERS]
        argv += ["--use-service-account-credentials=true", "--service-account-private-key-file", str(sa_key)]
        argv += ["--root-ca-file", str(self.pki.ca_file), "--cluster-cidr", "10.244.0.0/16", "-v", "1"]
        argv += ["--horizontal-pod-autoscaler-sync-period", HPA_SYNC_PERIOD]
        self._spawn("kube-controller-manager", argv)
        default_sa = "/api/v1/namespaces/default/serviceaccounts/default"
        self._wait("the default ServiceAccount", "kube-controller-manager", lambda: bool(self._admin().get(default_sa)))

    # helpers

    def _admin(self) -> ApiClient:
        assert self.api is not None, "the cluster is not started"
        return self.api

    def _spawn(self, name: str, argv: list[str], cwd: Path | None = None) -> None:
        self.processes[name] = spawn(argv, self.log_dir / f"{name}.log", cwd=cwd)

    def _wait(self, what: str, component: str, is_ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_error: Any = None
        while time.monotonic() < deadline:
            if self.processes[component].poll() is not None:
                raise RuntimeError(f"{component} exited while waiting for {what}:\n{self.log_tail(component)}")
            try:
                if is_ready():
                    return
            except (requests.RequestException, ApiError) as error:
                last_error = error
            time.sleep(0.5)
        raise TimeoutError(f"timed out waiting for {what} ({last_error}):\n{self.log_tail(component)}")


def _http_ok(url: str) -> bool:
    return http_get(url, 2.0).ok


def _is_node_ready(api: ApiClient, name: str) -> bool:
    conditions = api.get(f"/api/v1/nodes/{name}").get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
