"""A small Kubernetes API client over plain HTTP (requests), configured from a kubeconfig."""

from __future__ import annotations

import base64
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
import yaml


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class ApiClient:
    """JSON in, JSON out. Paths are API paths such as `/api/v1/namespaces/default/pods`."""

    def __init__(
        self,
        server: str,
        ca_file: str,
        cert: tuple[str, str] | None = None,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.server = server.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        self.session.trust_env = False  # else REQUESTS_CA_BUNDLE overrides `verify`, and proxies apply
        self.session.verify = ca_file
        self.session.cert = cert
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    @classmethod
    def from_kubeconfig(cls, path: str | Path) -> ApiClient:
        """Current context of a kubeconfig; inline `*-data` fields are written to temp files."""
        config = yaml.safe_load(Path(path).read_text())
        context_name = config["current-context"]
        context = _named(config["contexts"], context_name)["context"]
        cluster = _named(config["clusters"], context["cluster"])["cluster"]
        user = _named(config["users"], context["user"])["user"]
        ca_file = _file_or_data(cluster, "certificate-authority")
        cert_file = _file_or_data(user, "client-certificate")
        key_file = _file_or_data(user, "client-key")
        cert = (cert_file, key_file) if cert_file and key_file else None
        assert ca_file, f"{path}: the cluster needs a certificate-authority"
        return cls(cluster["server"], ca_file, cert=cert, token=user.get("token"))

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None, **params: Any) -> Any:
        response = self._send(method, path, body, content_type, params)
        return response.json() if response.content else None

    def get_raw(self, path: str) -> str:
        """The body as text, for endpoints such as /readyz that do not answer JSON."""
        return self._send("GET", path, None, None, {}).text

    def _send(
        self, method: str, path: str, body: Any, content_type: str | None, params: dict[str, Any]
    ) -> requests.Response:
        headers = {"Content-Type": content_type or "application/json"}
        data = None if body is None else json.dumps(body)
        response = self.session.request(
            method, self.server + path, data=data, params=params or None, headers=headers, timeout=self.timeout
        )
        if response.status_code >= 300:
            raise ApiError(method, path, response.status_code, response.text)
        return response

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, **params)

    def create(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 240) -> Iterator[dict[str, Any]]:
        """Watch events (`{"type": ..., "object": ...}`) from `resource_version` until the server ends it."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        with self.session.get(
            self.server + path, params=params, stream=True, timeout=(self.timeout, timeout_seconds + 30)
        ) as response:
            if response.status_code >= 300:
                raise ApiError("WATCH", path, response.status_code, response.text)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)


def http_get(url: str, timeout: float, **kwargs: Any) -> requests.Response:
    """A GET to a loopback address that no proxy or CA-bundle variable of the environment can redirect."""
    with requests.Session() as session:
        session.trust_env = False
        return session.get(url, timeout=timeout, **kwargs)


def _named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(item for item in items if item["name"] == name)


def _file_or_data(section: dict[str, Any], key: str) -> str | None:
    if key in section:
        return str(section[key])
    if f"{key}-data" not in section:
        return None
    with tempfile.NamedTemporaryFile("wb", prefix="kubeconfig-", delete=False) as handle:
        handle.write(base64.b64decode(section[f"{key}-data"]))
    return handle.name


def write_kubeconfig(
    path: Path,
    server: str,
    ca_file: Path,
    cert: tuple[Path, Path] | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> Path:
    """A one-context kubeconfig with a client cert or a bearer token."""
    user: dict[str, str] = {"token": token} if token else {}
    if cert:
        user = {"client-certificate": str(cert[0]), "client-key": str(cert[1])}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user", "namespace": namespace}}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
