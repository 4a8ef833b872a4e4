"""The operator's one context object, built at startup and kept in kopf's memo: API clients, the shared
residency cache (one GET /v1/adapters per pod serves every adapter), admin tokens, daemon wake-ups."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loraplane_operator import constants as c
from loraplane_operator.engine_client import EngineClient, engine_client
from loraplane_operator.network_builders import Peer
from loraplane_operator.server_status import PodInfo

Rows = dict[str, dict[str, Any]]  # adapter id -> the server's row


class ResidencyCache:
    """Per-pod adapter rows, fetched at most once per `ttl_s` however many adapters ask (single flight)."""

    def __init__(self, ttl_s: float = c.RESIDENCY_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._rows: dict[str, tuple[float, Rows]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def rows(self, url: str, fetch: Callable[[], Awaitable[list[dict[str, Any]]]]) -> Rows:
        async with self._locks.setdefault(url, asyncio.Lock()):
            cached = self._rows.get(url)
            if cached is not None and self.clock() - cached[0] < self.ttl_s:
                return cached[1]
            rows = {str(r["id"]): r for r in await fetch()}
            self._rows[url] = (self.clock(), rows)
            return rows

    def put(self, url: str, row: dict[str, Any]) -> None:
        """Remember a row a POST answered with, so the next readers see it before the next fetch."""
        if url in self._rows and "id" in row:
            self._rows[url][1][str(row["id"])] = row

    def drop(self, url: str, adapter_id: str | None = None) -> None:
        """Forget one adapter on a pod, or the whole pod (restarted or gone)."""
        if adapter_id is None:
            self._rows.pop(url, None)
            self._locks.pop(url, None)
        elif url in self._rows:
            self._rows[url][1].pop(adapter_id, None)


class TokenCache:
    """Admin tokens by (namespace, secret, key), re-read after `ttl_s` so a rotated Secret is picked up."""

    def __init__(self, ttl_s: float = c.TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._tokens: dict[tuple[str, str, str], tuple[float, str]] = {}

    async def get(self, key: tuple[str, str, str], read: Callable[[], Awaitable[str]]) -> str:
        cached = self._tokens.get(key)
        if cached is not None and self.clock() - cached[0] < self.ttl_s:
            return cached[1]
        token = await read()
        self._tokens[key] = (self.clock(), token)
        return token


@dataclass
class OperatorContext:
    """Everything the handlers share; one per operator process (kopf memo attribute `ctx`)."""

    api: Any  # kubernetes_asyncio.client.ApiClient
    http: httpx.AsyncClient
    peer: Peer | None = None  # the operator's own pods, for the servers' NetworkPolicy (None: not in a pod)
    residency: ResidencyCache = field(default_factory=ResidencyCache)
    tokens: TokenCache = field(default_factory=TokenCache)
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    pod_marks: dict[str, tuple[bool, int]] = field(default_factory=dict)  # pod uid -> (ready, restarts)
    slots: dict[str, asyncio.Semaphore] = field(default_factory=dict)  # pod url -> admin calls in flight
    # the prewarm gate (warmer.py): pods loaded and held out of rotation while they are prewarmed (they count in
    # placement), the task per pod uid (with the restart count it serves), and the run each uid was prewarmed for
    warming: dict[str, PodInfo] = field(default_factory=dict)
    warmers: dict[str, tuple[int, asyncio.Task]] = field(default_factory=dict)
    warmed: dict[str, int] = field(default_factory=dict)

    def slot(self, url: str) -> asyncio.Semaphore:
        return self.slots.setdefault(url, asyncio.Semaphore(c.PREWARM_CONCURRENCY))

    def admin(self, url: str, token: str | None, kind: str = c.ENGINE_LORAPLANE) -> EngineClient:
        """The engine client of the pod at `url`: our admin API, or vLLM's LoRA routes."""
        return engine_client(kind, self.http, url, token)

    def forget_pod(self, url: str) -> None:
        self.residency.drop(url)
        self.slots.pop(url, None)

    def warming_pods(self, namespace: str, server: str) -> list[PodInfo]:
        return [p for p in self.warming.values() if p.namespace == namespace and p.server == server]

    def drop_warmer(self, uid: str) -> None:
        """The pod is gone: stop its warmer, forget its marks."""
        entry = self.warmers.pop(uid, None)
        if entry is not None:
            entry[1].cancel()
        self.warming.pop(uid, None)
        self.warmed.pop(uid, None)

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    async def close(self) -> None:
        for _, task in self.warmers.values():
            task.cancel()
        await self.http.aclose()
        await self.api.close()
