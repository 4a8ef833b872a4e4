"""The router's view of one server pool: which pods are Ready, what each holds and how loaded it is.

Pods come from a fixed list of URLs, or from the Kubernetes API (the Ready pods with an IP matching a label
selector in one namespace, listed and then watched). Each poll (about every second) reads every pod's
residency (the admin token when the servers have one) and `/metrics` (requests waiting and running) in
parallel; a pod that does not answer drops out until it does. No operator is needed.

The engine kind says how: our servers' `/v1/adapters` (rows with tiers) and `loraplane_*` gauges, or vLLM's
`/v1/models` (an entry with a parent is a loaded adapter, tier "loaded": vLLM does not say GPU or host) and
`vllm:*` gauges. Our servers export vllm:* gauges too, so each engine reads only its own. A vLLM pod cannot
load an adapter on demand: nothing it is sent counts as loading there, only what its /v1/models lists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplane_server.serving.router.choice import PodView

log = logging.getLogger("loraplane.router")

PENDING_S = 30.0  # an adapter sent to a pod counts as loading there until its residency shows it, this long at most
LOAD_METRICS = ("loraplane_queue_depth", "loraplane_requests_running")
VLLM_LOAD_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running")
ENGINES = ("loraplane", "vllm")  # the server pods' engine kind (a BaseModelServer's spec.engine.kind)


@dataclass(frozen=True)
class Target:
    """A pod to poll: its name (what the ranking hashes), base URL, and the base URL of its admin routes (another
    port where the server runs with --admin-port; residency is read there)."""

    name: str
    url: str
    admin_url: str = ""

    @property
    def rows_url(self) -> str:
        return self.admin_url or self.url


def with_port(url: str, port: int | None) -> str:
    """`url` with its port replaced (None: unchanged)."""
    if port is None:
        return url
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return parts._replace(netloc=f"{host}:{port}").geturl()


ADMIN_PORT_NAME = "admin"  # a server pod's container port for its admin routes (the operator names it so)


def named_port(pod: Any, name: str) -> int | None:
    """The container port of that name in a pod (a kubernetes_asyncio V1Pod), None if none is named so: each pod
    says where its admin routes are, so pods made before an admin port existed keep theirs on the API port."""
    for container in (pod.spec.containers if pod.spec is not None else None) or []:
        for port in container.ports or []:
            if port.name == name:
                return int(port.container_port)
    return None


def static_targets(pods: Iterable[str], admin_port: int | None = None) -> list[Target]:
    """Targets from `URL` or `NAME=URL` entries; a pod without a name is named host:port. The name is what the
    ranking hashes: give the Kubernetes pod names to agree with the operator's placement. With `admin_port`, each
    pod's admin routes are on that port of its host."""
    targets = []
    for entry in pods:
        name, _, url = entry.partition("=") if "=" in entry.split("://", 1)[0] else ("", "", entry)
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--pod {entry!r}: expected [NAME=]http(s)://host:port")
        address = f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname  # never user:password
        base = url.rstrip("/")
        targets.append(Target(name or address, base, with_port(base, admin_port) if admin_port else ""))
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("--pod: two pods with one name")
    return targets


class KubePods:
    """The Ready pods matching `selector` in `namespace`, from the Kubernetes API (in-cluster config, else the
    kubeconfig), as targets on `port`: listed once, then kept current by a watch (`watch`), listed again after
    the watch ends or fails (410 Gone included). `changed` is set on every change, so the pool reads a new pod,
    and forgets a deleted one, at once rather than at its next poll."""

    def __init__(self, namespace: str, selector: str, port: int, admin_port: int | None = None) -> None:
        self.namespace, self.selector, self.port, self.admin_port = namespace, selector, port, admin_port
        self._api: Any = None
        self._pods: dict[str, Target] = {}
        self.listed = False
        self.lists = 0  # full lists so far (the first, then one per watch that ended)
        self.changed = asyncio.Event()

    async def _core(self) -> Any:
        from kubernetes_asyncio import client, config

        if self._api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
            self._api = client.ApiClient()
        return client.CoreV1Api(self._api)

    async def targets(self) -> list[Target]:
        if not self.listed:
            await self._list()
        return sorted(self._pods.values(), key=lambda t: t.name)

    async def _list(self) -> str:
        core = await self._core()
        pods = await core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        found = {}
        for pod in pods.items:
            target = self._target(pod)
            if target is not None:
                found[target.name] = target
        self._pods, self.listed = found, True
        self.lists += 1
        self.changed.set()
        return str(pods.metadata.resource_version)

    def _target(self, pod: Any) -> Target | None:
        if pod.status is None or pod.metadata is None:
            return None
        conditions = pod.status.conditions or []
        ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
        if ready and pod.status.pod_ip and not pod.metadata.deletion_timestamp:
            url = f"http://{pod.status.pod_ip}:{self.port}"
            admin_port = named_port(pod, ADMIN_PORT_NAME) or self.admin_port
            return Target(pod.metadata.name, url, with_port(url, admin_port) if admin_port else "")
        return None

    def _apply(self, kind: str, pod: Any) -> None:
        name = pod.metadata.name
        target = None if kind == "DELETED" else self._target(pod)
        before = self._pods.get(name)
        if target is None:
            self._pods.pop(name, None)
        else:
            self._pods[name] = target
        if before != target:
            self.changed.set()

    async def watch(self, stopped: asyncio.Event, timeout_s: int = 240) -> None:
        """List, then watch from that list's resource version until `stopped` (run it as a task and cancel it);
        a watch that ends is followed by a new list, a failure by one after a backoff (1 s doubling to 30 s)."""
        from kubernetes_asyncio import watch

        backoff = 1.0
        while not stopped.is_set():
            try:
                version = await self._list()
                core = await self._core()
                async with watch.Watch().stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    timeout_seconds=timeout_s,
                ) as events:
                    async for event in events:
                        if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                            self._apply(str(event["type"]), event["object"])
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the API server is away: keep the last view, try again
                log.warning("router: watching the server pods failed (%s); again in %.0f s", exc, backoff)
                try:
                    await asyncio.wait_for(stopped.wait(), timeout=backoff)
                except asyncio.TimeoutError:
                    pass
                backoff = min(backoff * 2, 30.0)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()


class Pool:
    """The Ready pods as PodViews, refreshed by `poll`; this router's in-flight counts survive a refresh."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        static: list[Target] | None = None,
        kube: KubePods | None = None,
        admin_token: str | None = None,
        timeout_s: float = 1.0,
        engine: str = "loraplane",
    ) -> None:
        if (static is None) == (kube is None):
            raise ValueError("a pool takes either a list of pods or a Kubernetes selector")
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
        self.http, self.static, self.kube, self.engine = http, static, kube, engine
        self.loads_on_demand = engine == "loraplane"  # our server loads any adapter it is sent; vLLM 404s
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.timeout_s = timeout_s
        self.pods: dict[str, PodView] = {}
        self.polls = 0
        self.base_models: set[str] = set()  # vllm: the /v1/models entries without a parent, as last polled

    def ready(self) -> list[PodView]:
        return list(self.pods.values())

    async def poll(self) -> None:
        """One refresh of every pod's residency and load."""
        try:
            targets = self.static if self.static is not None else await self.kube.targets()  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the API server is unreachable: keep the last view
            log.warning("router: cannot list the server pods: %s", exc)
            return
        views = await asyncio.gather(*(self._read(t) for t in targets))
        fresh: dict[str, PodView] = {}
        for view in views:
            if view is not None:
                old = self.pods.get(view.name)
                if old is not None and old.url == view.url:
                    view.in_flight = old.in_flight
                    view.others = max(0, view.queued - old.in_flight)
                    now = time.monotonic()
                    view.pending = {
                        a: t for a, t in old.pending.items() if view.tier_of(a) >= 2 and now - t < PENDING_S
                    }
                fresh[view.name] = view
        self.pods = fresh
        self.polls += 1

    async def _read(self, target: Target) -> PodView | None:
        if self.engine == "vllm":
            return await self._read_vllm(target)
        try:
            rows, metrics = await asyncio.gather(
                self.http.get(f"{target.rows_url}/v1/adapters", headers=self.headers, timeout=self.timeout_s),
                self.http.get(f"{target.url}/metrics", timeout=self.timeout_s),
            )
            rows.raise_for_status()
            metrics.raise_for_status()
            residency = {
                str(r["id"]): str(r.get("tier") or "")
                for r in rows.json().get("data", [])
                if isinstance(r, dict) and r.get("state") not in ("failed", "loading")
            }
            queued = _load(metrics.text)
            return PodView(target.name, target.url, residency, queued=queued, others=queued)
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as exc:
            log.info("router: pod %s left out this round: %s", target.name, exc)
            return None

    async def _read_vllm(self, target: Target) -> PodView | None:
        """A vLLM pod: its loaded adapters from /v1/models (the admin token is its --api-key), its load from
        vllm:num_requests_waiting + vllm:num_requests_running."""
        try:
            models, metrics = await asyncio.gather(
                self.http.get(f"{target.url}/v1/models", headers=self.headers, timeout=self.timeout_s),
                self.http.get(f"{target.url}/metrics", timeout=self.timeout_s),
            )
            models.raise_for_status()
            metrics.raise_for_status()
            entries = [m for m in models.json()["data"] if isinstance(m, dict)]
            residency = {str(m["id"]): "loaded" for m in entries if m.get("parent") is not None}
            bases = {str(m["id"]) for m in entries if m.get("parent") is None}
            queued = _load(metrics.text, VLLM_LOAD_METRICS)
        except (httpx.HTTPError, ValueError, KeyError, AttributeError, TypeError) as exc:
            log.info("router: pod %s left out this round: %s", target.name, exc)
            return None
        if bases:
            self.base_models = bases
        return PodView(target.name, target.url, residency, queued=queued, others=queued)

    async def run(self, interval_s: float, stopped: asyncio.Event, after: Callable[[], None] | None = None) -> None:
        """Poll every `interval_s`, and at once when the Kubernetes watch reports a change; `after` each poll."""
        changed = self.kube.changed if self.kube is not None else asyncio.Event()
        while not stopped.is_set():
            changed.clear()
            await self.poll()
            if after is not None:
                after()
            waits = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(changed.wait())]
            try:
                await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()

    def acquire(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is not None:
            pod.in_flight += 1

    def sent(self, name: str, adapter_id: str) -> None:
        """A request for `adapter_id` went to pod `name`: unless in memory there, the pod is loading it now (our
        server; a vLLM pod loads nothing on demand)."""
        pod = self.pods.get(name)
        # on its disk or not there: it loads it now
        if pod is not None and self.loads_on_demand and pod.tier_of(adapter_id) >= 2:
            pod.pending[adapter_id] = time.monotonic()

    def release(self, name: str, served: str | None = None) -> None:
        """A request on pod `name` ended; `served`: it was answered in full for that adapter, so the pod has
        loaded it (in memory there until the next poll says otherwise). A vLLM pod's residency is only what its
        /v1/models lists."""
        pod = self.pods.get(name)
        if pod is None:
            return
        pod.in_flight = max(0, pod.in_flight - 1)
        if served is not None and self.loads_on_demand and pod.tier_of(served) >= 2:
            pod.residency = {**pod.residency, served: "host"}
            pod.pending.pop(served, None)


def _load(text: str, names: tuple[str, ...] = LOAD_METRICS) -> int:
    """Requests waiting plus running (the gauges `names`, summed over their label sets), from a Prometheus text
    exposition."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in names:
            total += sum(sample.value for sample in family.samples)
    return int(total)
