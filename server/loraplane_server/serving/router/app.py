"""`loraplane router`: a stateless HTTP front for one server pool, passing each request through to one pod.

The adapter comes from the body (OpenAI `model`, LoRAX `parameters.adapter_id`); `choice.choose` orders the
pods for it. A pod that cannot be reached before any byte of its answer, or that refuses the request at the
door (429 queue full, 503 loading or draining), is left for the next one in that order; once the answer has
started it streams through as it comes (SSE included), and a client that hangs up closes the upstream
request, so the pod aborts it. Every routed answer names its pod (`x-loraplane-pod`). Adapter admin is per pod
and not routed (404 with a hint). A request that finds no Ready pod (a pool scaled to zero, or restarting) waits
in the hold (serving/router/hold.py) for one, bounded in number and time, then gets a 503 with Retry-After; the
held count is what wakes a pool at zero. The router's own /health, /ready (some pod Ready, or the hold on) and
/metrics (serving/router/metrics.py; the pods' own metrics are scraped from the pods).

`engine` is the pods' kind: our servers, or vLLM pods (residency and load read from vLLM's routes; an adapter
goes only to the pods holding it, as a vLLM pod cannot load one on demand).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loraplane_server.serving.router.choice import MIN_BOUND, TIER_ORDER, PodView, Spill, choose
from loraplane_server.serving.router.hold import Hold, HoldFull
from loraplane_server.serving.router.metrics import RouterMetrics
from loraplane_server.serving.router.pool import ENGINES, KubePods, Pool, static_targets

log = logging.getLogger("loraplane.router")

REFUSED_AT_THE_DOOR = (
    429,
    503,
)  # a server pod's answers to a request it did not start (serving/http/state.py)
POD_HEADER = "x-loraplane-pod"  # on every routed answer: the pod that served it
GENERATION_ROUTES = ("/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions")
ADMIN_PREFIXES = ("/v1/adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/debug", "/v1/prewarm")
# hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx sets itself
_DROP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
     "content-length"}
)  # fmt: skip


@dataclass(frozen=True)
class RouterConfig:
    """One router process: where its pods are and how it picks among them."""

    pods: tuple[str, ...] = ()  # fixed pod URLs; or namespace + selector
    namespace: str | None = None
    selector: str | None = None
    pod_port: int = 8080
    pod_admin_port: int | None = None  # where the pods serve /v1/adapters (their --admin-port); None: pod_port
    admin_token: str | None = None  # the servers' admin token: /v1/adapters (residency) needs it
    epsilon: float = 0.5  # load bound: (1 + epsilon) x the mean (hot adapters spread by spilling)
    min_bound: int = MIN_BOUND  # ... but never under this many requests a pod
    spill_queue: int = 8  # widen an adapter's home when all its pods hold this many requests
    poll_s: float = 1.0
    max_tries: int = 3  # pods tried before the first byte
    connect_timeout_s: float = 2.0
    adapter_labels: int = 64  # adapters with their own metric series (the busiest)
    engine: str = "loraplane"  # the pods' engine kind: loraplane or vllm (admin_token: vLLM's --api-key)
    hold_max: int = 256  # requests held at once while no pod is Ready (0: refuse at once)
    hold_timeout_s: float = 120.0  # how long a held request waits for a Ready pod (0: refuse at once)

    def __post_init__(self) -> None:
        if bool(self.pods) == bool(self.selector):
            raise ValueError("give either --pod URLs or --selector (with --namespace)")
        if self.selector and not self.namespace:
            raise ValueError("--selector needs --namespace")
        if self.epsilon < 0 or self.spill_queue < 1 or self.poll_s <= 0 or self.max_tries < 1 or self.min_bound < 1:
            raise ValueError("epsilon >= 0, min_bound >= 1, spill_queue >= 1, poll_s > 0 and max_tries >= 1")
        if self.adapter_labels < 0:
            raise ValueError("adapter_labels >= 0")
        if self.hold_max < 0 or self.hold_timeout_s < 0:
            raise ValueError("--hold-max and --hold-timeout must be >= 0")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: expected one of {', '.join(ENGINES)}")


def adapter_of(path: str, body: bytes, base_models: set[str]) -> str | None:
    """The adapter a generation request names; None for the base model (or a body the pod will refuse)."""
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if path.startswith("/v1/"):
        model = data.get("model")
        return model if isinstance(model, str) and model and model not in base_models else None
    params = data.get("parameters")
    adapter = params.get("adapter_id") if isinstance(params, dict) else None
    return adapter if isinstance(adapter, str) and adapter else None


class Router:
    def __init__(self, config: RouterConfig, http: httpx.AsyncClient) -> None:
        self.config, self.http = config, http
        selector, admin_port = config.selector, config.pod_admin_port
        kube = KubePods(config.namespace or "", selector, config.pod_port, admin_port) if selector else None
        static = static_targets(config.pods, admin_port) if config.pods else None
        self.pool = Pool(http, static=static, kube=kube, admin_token=config.admin_token, engine=config.engine)
        self.spill = Spill(queue_threshold=config.spill_queue)
        self.metrics = RouterMetrics(config.adapter_labels)
        self.hold = Hold(config.hold_max, config.hold_timeout_s)
        self.metrics.watch_pool(lambda: len(self.pool.pods), lambda: self.spill.widths, lambda: self.hold.held)
        self.base_models: set[str] = set()

    def order(self, adapter_id: str | None) -> list[PodView]:
        pods = self.pool.ready()
        width = 1
        if adapter_id is not None:
            width = self._observe(adapter_id, pods, time.monotonic())
        on_demand = self.pool.loads_on_demand
        return choose(adapter_id, pods, width, self.config.epsilon, self.config.min_bound, on_demand=on_demand)

    def _observe(self, adapter_id: str, pods: list[PodView], now: float) -> int:
        before = self.spill.spills
        width = self.spill.observe(adapter_id, pods, now)
        self.metrics.spills.inc(self.spill.spills - before)
        return width

    def after_poll(self) -> None:
        """Spilled adapters narrow back even when no request for them comes (their width is re-read per poll)."""
        pods, now = self.pool.ready(), time.monotonic()
        for adapter_id in list(self.spill.widths):
            self._observe(adapter_id, pods, now)
        if pods:
            self.hold.wake()

    async def learn_base_models(self) -> None:
        """The base model's names, from a pod's /v1/models (entries with no parent); on vLLM pods the poll reads
        that route already."""
        if self.pool.base_models:
            self.base_models = set(self.pool.base_models)
            return
        for pod in self.pool.ready():
            try:
                response = await self.http.get(f"{pod.url}/v1/models", timeout=self.config.connect_timeout_s)
                names = {m["id"] for m in response.json()["data"] if m.get("parent") is None}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
            self.base_models = names
            return

    async def forward(self, request: Request) -> Response:
        path = request.url.path
        if path.startswith(ADMIN_PREFIXES):
            return _error(
                404, "adapter admin is per pod: call a pod's admin port (8081 under the operator) or use the operator"
            )
        body = await request.body()
        if not self.base_models:
            await self.learn_base_models()
        adapter_id = adapter_of(path, body, self.base_models) if path in GENERATION_ROUTES else None
        order = self.order(adapter_id)
        if not order:
            refused = await self._hold(adapter_id)
            if isinstance(refused, Response):
                return refused
            order = refused
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS]
        candidates = order[: self.config.max_tries]
        for tried, pod in enumerate(candidates):
            upstream = self.http.build_request(
                request.method, pod.url + path, params=request.query_params, headers=headers, content=body
            )
            started = time.monotonic()
            self.pool.acquire(pod.name)
            try:
                response = await self.http.send(upstream, stream=True)
            except httpx.TransportError as exc:
                # no answer began (refused, reset, closed while the request was written or before its head, pool
                # exhausted): the pod did not answer this request, the next one may. The read timeout is off
                # (generation takes as long as it takes), so a timeout here is a connect or pool one.
                self.pool.release(pod.name)
                self.metrics.retries.inc()
                log.info("router: %s unreachable (%s); trying the next pod", pod.name, type(exc).__name__)
                continue
            except BaseException:
                self.pool.release(pod.name)
                raise
            self.metrics.upstream.observe(time.monotonic() - started)
            if response.status_code in REFUSED_AT_THE_DOOR and tried + 1 < len(candidates):
                # refused before any work (loading, draining, queue full): nothing was generated, the next pod
                # may take it
                await response.aclose()
                self.pool.release(pod.name)
                self.metrics.retries.inc()
                log.info("router: %s answered %d; trying the next pod", pod.name, response.status_code)
                continue
            self.metrics.routed(pod.name, adapter_id, tier_name(pod, adapter_id))
            if adapter_id is not None and response.status_code < 400:
                self.pool.sent(pod.name, adapter_id)
            if tried:
                log.info("router: %s served after %d pods unreachable or refusing", pod.name, tried)
            served = adapter_id if response.status_code == 200 else None
            done = _Done(response, functools.partial(self.pool.release, pod.name), served)
            reply_headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_HEADERS}
            reply_headers[POD_HEADER] = pod.name
            return StreamingResponse(
                _relay(response, done),
                status_code=response.status_code,
                headers=reply_headers,
                background=BackgroundTask(done),
            )
        self.metrics.failures.labels("unreachable").inc()
        return _error(502, f"no server pod answered (tried {min(len(order), self.config.max_tries)})")

    async def _hold(self, adapter_id: str | None) -> list[PodView] | Response:
        """No pod is Ready: wait in the hold for one (the pool scaled to zero wakes on the held count); the
        pods' order once one is, or the 503 to answer."""
        if not self.hold.enabled:
            self.metrics.failures.labels("no_ready_pod").inc()
            return _error(503, "no Ready server pod", headers={"Retry-After": "1"})
        try:
            order, waited = await self.hold.wait(lambda: self.order(adapter_id) or None)
        except HoldFull:
            self.metrics.failures.labels("hold_full").inc()
            message = f"no Ready server pod, and {self.hold.max_held} requests already wait for one"
            return _error(503, message, headers={"Retry-After": str(max(1, round(self.hold.timeout_s)))})
        if order is None:
            self.metrics.failures.labels("hold_timeout").inc()
            message = f"no server pod became Ready within {self.hold.timeout_s:g} s (the pool may be scaling up)"
            return _error(503, message, headers={"Retry-After": "5"})
        self.metrics.held.observe(waited)
        log.info("router: a held request goes to %s after %.1f s", order[0].name, waited)
        return order


def tier_name(pod: PodView, adapter_id: str | None) -> str:
    """The metric's tier label: base (no adapter), device, host, disk, loaded (vLLM) or none (not resident)."""
    if adapter_id is None:
        return "base"
    tier = pod.residency.get(adapter_id, "")
    return tier if tier in TIER_ORDER else "none"


class _Done:
    """Closes the upstream response and releases the pod, once, whichever comes first: the end of the relay
    (or its cancellation when the client hangs up) or the response's background task. An answer relayed in full
    tells the pool the pod holds its adapter now."""

    def __init__(self, response: httpx.Response, release: Callable[[str | None], None], adapter_id: str | None) -> None:
        self.response, self.release, self.adapter_id = response, release, adapter_id
        self.is_done = self.relayed = False

    async def __call__(self) -> None:
        if not self.is_done:
            self.is_done = True
            self.release(self.adapter_id if self.relayed else None)
            await self.response.aclose()


async def _relay(response: httpx.Response, done: _Done) -> AsyncIterator[bytes]:
    """The pod's bytes as they come; a client that hangs up cancels this, which closes the upstream request."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
        done.relayed = True
    finally:
        await done()


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "unavailable" if status >= 500 else "not_found"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def create_router_app(config: RouterConfig) -> Starlette:
    state: dict[str, Router] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            router = state["router"] = Router(config, http)
            stopped = asyncio.Event()
            kube = router.pool.kube
            watcher = asyncio.create_task(kube.watch(stopped)) if kube is not None else None
            await router.pool.poll()
            poller = asyncio.create_task(router.pool.run(config.poll_s, stopped, router.after_poll))
            try:
                yield
            finally:
                stopped.set()
                await poller
                if watcher is not None:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                if router.pool.kube is not None:
                    await router.pool.kube.close()

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        router = state["router"]
        pods = router.pool.ready()
        if pods:
            return JSONResponse({"status": "ready", "pods": sorted(p.name for p in pods)})
        if router.hold.enabled:  # it takes requests and holds them: what wakes a pool scaled to zero
            return JSONResponse({"status": "holding: no Ready server pod", "pods": []})
        return JSONResponse({"status": "no Ready server pod", "pods": []}, 503)

    async def metrics(request: Request) -> Response:
        router = state["router"]
        router.metrics.pods_now(list(router.pool.pods))
        return Response(generate_latest(state["router"].metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def forward(request: Request) -> Response:
        return await state["router"].forward(request)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/{path:path}", forward, methods=["GET", "POST", "DELETE", "PUT", "PATCH"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
