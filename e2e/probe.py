"""One probe attempt (httpGet, tcpSocket, exec) and the threshold bookkeeping around it."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass, field
from typing import Any

import requests
import urllib3

from e2e.api import http_get

urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    """A probe port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    return next(int(p["containerPort"]) for p in container.get("ports", []) if p.get("name") == port)


def probe_once(probe: dict[str, Any], pod_ip: str, container: dict[str, Any], env: dict[str, str]) -> bool:
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            scheme = spec.get("scheme", "HTTP").lower()
            port = resolve_port(spec["port"], container)
            url = f"{scheme}://{spec.get('host') or pod_ip}:{port}{spec.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders", [])}
            response = http_get(url, timeout, headers=headers, verify=False, allow_redirects=False)
            return 200 <= response.status_code < 400
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            address = (spec.get("host") or pod_ip, resolve_port(spec["port"], container))
            with socket.create_connection(address, timeout=timeout):
                return True
        if "exec" in probe:
            result = subprocess.run(probe["exec"]["command"], env=env, timeout=timeout, capture_output=True)
            return result.returncode == 0
    except (requests.RequestException, OSError, subprocess.TimeoutExpired, StopIteration):
        return False
    raise ValueError(f"unsupported probe: {probe}")


@dataclass
class ProbeState:
    """Kubernetes' thresholds: passing after successThreshold successes in a row, failing after failureThreshold."""

    probe: dict[str, Any]
    is_passing: bool
    next_at: float = 0.0
    num_failures: int = field(default=0, repr=False)  # in a row
    num_successes: int = field(default=0, repr=False)  # in a row

    @property
    def period(self) -> float:
        return float(self.probe.get("periodSeconds", 10))

    @property
    def has_failed(self) -> bool:
        return self.num_failures >= int(self.probe.get("failureThreshold", 3))

    def record(self, ok: bool) -> None:
        self.num_successes = self.num_successes + 1 if ok else 0
        self.num_failures = 0 if ok else self.num_failures + 1
        if self.num_successes >= int(self.probe.get("successThreshold", 1)):
            self.is_passing = True
        elif self.has_failed:
            self.is_passing = False
