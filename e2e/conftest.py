"""Session fixtures: the control plane binaries, a running LocalCluster with the process kubelet, kubectl, helm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import REPO_ROOT, LocalCluster
from e2e.helm import Helm, find_helm
from e2e.kubectl import Kubectl

BUILD_SCRIPT = Path(__file__).with_name("build_control_plane.sh")
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: needs the local Kubernetes control plane (e2e/)")


# run last, in this order: the autoscaling tests (their Prometheus and KEDA may still be building in the background
# on a fresh machine), then the audit (it reads the audit log of everything before it)
LAST_MODULES = ("test_autoscaling", "test_rbac_audit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        stem = Path(str(item.fspath)).stem
        return LAST_MODULES.index(stem) + 1 if stem in LAST_MODULES else 0

    items.sort(key=rank)  # stable: the rest keep their order


def _bin_dir() -> Path:
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _is_built(bin_dir: Path) -> bool:
    return (bin_dir / ".complete").exists() and all((bin_dir / b).exists() for b in BINARIES)


@pytest.fixture(scope="session")
def control_plane() -> Path:
    """The bin dir with etcd, kube-apiserver and kube-controller-manager; builds them if allowed."""
    bin_dir = _bin_dir()
    if _is_built(bin_dir):
        return bin_dir
    if shutil.which("go") is None:
        pytest.skip("Go is not available")
    if os.environ.get("LORAPLANE_E2E_BUILD") != "1":
        pytest.skip(
            f"the control plane is not built in {bin_dir}: run e2e/build_control_plane.sh once "
            "(tens of minutes) or set LORAPLANE_E2E_BUILD=1"
        )
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    return bin_dir


@pytest.fixture(scope="session")
def cluster(control_plane: Path) -> Iterator[LocalCluster]:
    """etcd + kube-apiserver (RBAC) + kube-controller-manager + the process kubelet; all stopped at the end."""
    with LocalCluster(control_plane) as local_cluster:
        local_cluster.start_kubelet()
        yield local_cluster


@pytest.fixture(scope="session")
def kubectl(cluster: LocalCluster) -> Kubectl:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not available")
    return Kubectl(cluster.kubeconfig)


@pytest.fixture(scope="session")
def helm(cluster: LocalCluster) -> Helm:
    binary = find_helm()
    if binary is None:
        pytest.skip("helm is not available: helm/get_helm.sh could not fetch it and there is none on PATH")
    return Helm(binary, cluster.kubeconfig, cluster.dir / "helm")


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="session")
def minio() -> Iterator[Any]:
    """A real MinIO server on loopback (tests/s3_server.py's MinioServer; skipped, with the command that builds
    it, when the binary is missing and LORAPLANE_E2E_BUILD is not 1)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from s3_server import MinioServer  # type: ignore[import-not-found]

    with MinioServer() as server:
        yield server
