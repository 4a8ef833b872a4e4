"""kubectl against one cluster, and polling until a condition holds."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class KubectlError(RuntimeError):
    def __init__(self, args: list[str], code: int, stderr: str) -> None:
        super().__init__(f"kubectl {' '.join(args)} exited {code}: {stderr.strip()}")
        self.stderr = stderr


class Kubectl:
    """`kubectl("get", "pods")` runs kubectl with this kubeconfig; returns stdout, raises KubectlError."""

    def __init__(self, kubeconfig: Path, binary: str = "kubectl") -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary

    def __call__(self, *args: str, input: str | None = None, timeout: float = 60.0) -> str:
        argv = [self.binary, "--kubeconfig", str(self.kubeconfig), *args]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise KubectlError(list(args), result.returncode, result.stderr)
        return result.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    def apply(self, manifest: dict[str, Any], namespace: str | None = None) -> str:
        extra = ["-n", namespace] if namespace else []
        return self("apply", *extra, "-f", "-", input=json.dumps(manifest))

    def with_kubeconfig(self, kubeconfig: Path) -> Kubectl:
        return Kubectl(kubeconfig, self.binary)


def wait_until(
    check: Callable[[], T | None], timeout: float = 60.0, what: str = "condition", interval: float = 0.5
) -> T:
    """Polls `check` until it returns something truthy (returned); exceptions count as not yet."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as error:  # noqa: BLE001 - a poll that fails is a poll that is not done yet
            last = error
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)
