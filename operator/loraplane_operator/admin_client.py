"""Async client of a server pod's adapter admin API: GET/POST /v1/adapters, POST /v1/adapters/{id}/tier,
DELETE /v1/adapters/{id}, and POST /v1/prewarm/complete (the prewarm gate).

Errors are typed for the operator's retry decisions: `RetryableAdminError` (connection failures, timeouts,
404, 408, 409 adapter in use, 425, 429, 5xx) and `PermanentAdminError` (other 4xx: not allowed, invalid
adapter or source; with the server's message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from loraplane_operator import constants as c
from loraplane_operator.metrics import CountingTransport

RETRYABLE_STATUSES = frozenset({404, 408, 409, 425, 429})  # 4xx that may pass: unknown yet, busy, overloaded


def is_permanent_status(status: int) -> bool:
    """A refusal that retrying cannot change: a 4xx other than the RETRYABLE_STATUSES."""
    return 400 <= status < 500 and status not in RETRYABLE_STATUSES


class AdminError(Exception):
    """A failed admin call: what the server (or the network) said."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after = retry_after


class RetryableAdminError(AdminError):
    """Worth retrying later: the pod is unreachable, busy or overloaded."""


class PermanentAdminError(AdminError):
    """The server refused the request itself (bad source, not allowed, bad token): retrying will not help."""


def make_http_client(timeout_s: float = c.ADMIN_TIMEOUT_S) -> httpx.AsyncClient:
    """One pooled client for all pods, counting its calls (metrics.ADMIN_CALLS); proxies from the environment are
    ignored (pod IPs are in-cluster)."""
    timeout = httpx.Timeout(timeout_s, pool=120.0)  # many adapters may queue for one pod's connections
    transport = CountingTransport(httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=64)))
    return httpx.AsyncClient(timeout=timeout, trust_env=False, transport=transport)


def error_message(response: httpx.Response) -> str:
    """The server's message from an OpenAI-style ({"error": {"message"}}) or LoRAX-style body, else the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str):
        return err
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return response.text[:500]


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def classify(response: httpx.Response) -> AdminError:
    status = response.status_code
    message = f"{response.request.method} {response.request.url.path}: {status} {error_message(response)}"
    if is_permanent_status(status):
        return PermanentAdminError(message, status)
    return RetryableAdminError(message, status, _retry_after(response))


@dataclass(frozen=True)
class AdminClient:
    """The admin API of one pod at `base_url` (http://ip:port), with an optional bearer token."""

    http: httpx.AsyncClient
    base_url: str
    token: str | None = None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            return await self.http.request(method, self.base_url + path, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise RetryableAdminError(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc

    async def list_adapters(self) -> list[dict[str, Any]]:
        """Every adapter the pod knows: id, source, state, tier, rank, size_bytes, pinned, last_error, ..."""
        response = await self._call("GET", "/v1/adapters")
        if response.status_code != 200:
            raise classify(response)
        return list(response.json().get("data") or [])

    async def prewarm(self, adapter_id: str, source: str | None, tier: str, pinned: bool | None = None) -> dict:
        """Register (with a source) and start loading up to `tier`; the adapter's row as the server sees it."""
        body: dict[str, Any] = {"id": adapter_id, "tier": tier}
        if source is not None:
            body["source"] = source
        if pinned is not None:
            body["pinned"] = pinned
        response = await self._call("POST", "/v1/adapters", body)
        if response.status_code != 200:
            raise classify(response)
        return dict(response.json())

    async def set_tier(self, adapter_id: str, tier: str) -> dict:
        """Move a known adapter to exactly `tier` (promote or demote); its row, with "target_tier" while moving."""
        response = await self._call("POST", f"/v1/adapters/{quote(adapter_id, safe='')}/tier", {"tier": tier})
        if response.status_code != 200:
            raise classify(response)
        return dict(response.json())

    async def unload(self, adapter_id: str) -> bool:
        """Forget the adapter on every tier; False if the pod did not know it."""
        response = await self._call("DELETE", f"/v1/adapters/{quote(adapter_id, safe='')}")
        if response.status_code == 404:
            return False
        if response.status_code != 200:
            raise classify(response)
        return True

    async def prewarm_complete(self) -> bool:
        """Open the pod's prewarm gate (its /ready turns 200); False where it was open already."""
        response = await self._call("POST", "/v1/prewarm/complete")
        if response.status_code != 200:
            raise classify(response)
        return bool(response.json().get("opened"))
