"""`loraplane router` in front of two real `loraplane serve` processes on loopback, through the openai and
lorax clients: each adapter's requests go to the first pod of its ranking and load there alone, two routers
agree, streams pass through, a client that hangs up aborts the pod's request, and a pod that stops answering
is skipped before the first byte."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from lorax import Client
from openai import OpenAI
from test_http_support import ADMIN_TOKEN, REPO, ServerProcess, admin_headers, free_port, make_adapter_set, wait_idle

from loraplane_server.serving.router.ranking import rank

ADAPTERS = [f"tenant-{i}" for i in range(6)]
POD_NAMES = ["pod-a", "pod-b"]  # what the ranking hashes (--pod NAME=URL): the same split in every run
PROMPT = "The capital of France is"


class RouterProcess:
    def __init__(self, pods: list[ServerProcess], log_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "loraplane_server.serving.cli", "router", "--port", str(self.port), *flags]
        for name, pod in zip(POD_NAMES[: len(pods)], pods, strict=True):
            cmd += ["--pod", f"{name}={pod.url}"]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self.log_path = log_path

    def wait_ready(self, num_pods: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                r = httpx.get(f"{self.url}/ready", timeout=2)
                if r.status_code == 200 and len(r.json()["pods"]) == num_pods:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.log_path.read_text())

    def routed(self) -> dict[tuple[str, str], float]:
        """loraplane_router_requests by (pod, tier)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line.startswith("loraplane_router_requests_total{"):
                labels = dict(kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].split(","))
                out[(labels["pod"].strip('"'), labels["tier"].strip('"'))] = float(line.rsplit(" ", 1)[1])
        return out

    def gauge(self, series: str) -> float:
        """The value of one series as the metrics text names it (`name` or `name{labels}`); 0 when absent."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == series)

    def counter(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}_total"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def pool(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    adapters = make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "router-adapters", ADAPTERS)
    logs = tmp_path_factory.mktemp("router-pool")
    flags = ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-loras", "4", "--adapter-dir", str(adapters)]
    pods = [ServerProcess(flags, logs / f"pod{i}.log", env={"LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN}) for i in range(2)]
    try:
        for pod in pods:
            pod.wait_ready()
        yield pods
    finally:
        for pod in pods:
            pod.stop()


def home(adapter: str, pods: list[ServerProcess]) -> ServerProcess:
    by_name = dict(zip(POD_NAMES, pods, strict=True))
    return by_name[rank(adapter, by_name)[0]]


def rows(pod: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{pod.url}/v1/adapters", headers=admin_headers(), timeout=10)
    return {row["id"]: row for row in r.json()["data"]}


def test_adapters_load_only_on_their_home_pod_and_two_routers_agree(pool: list[ServerProcess], tmp_path: Path) -> None:
    routers = [RouterProcess(pool, tmp_path / f"router{i}.log", "--poll-seconds", "0.2") for i in range(2)]
    try:
        for r in routers:
            r.wait_ready(len(pool))
        homes = {a: home(a, pool) for a in ADAPTERS}
        assert len({h.url for h in homes.values()}) == 2  # both pods are home to some adapter
        texts: dict[str, set[str]] = {a: set() for a in ADAPTERS}
        for router in routers:
            oai = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
            for adapter in ADAPTERS:
                answer = oai.completions.create(model=adapter, prompt=PROMPT, max_tokens=6, temperature=0)
                texts[adapter].add(answer.choices[0].text)
        assert all(len(t) == 1 for t in texts.values()), texts  # greedy: the same text from either router
        for pod in pool:
            loaded = {a for a, row in rows(pod).items() if row["tier"] in ("device", "host")}
            assert loaded == {a for a, h in homes.items() if h is pod}, (pod.url, loaded)
        for router in routers:  # each router sent each adapter to its home, the same pods
            per_pod = {}
            for (pod_name, _), n in router.routed().items():
                per_pod[pod_name] = per_pod.get(pod_name, 0) + n
            expected: dict[str, int] = {}
            for a in ADAPTERS:
                name = rank(a, POD_NAMES)[0]
                expected[name] = expected.get(name, 0) + 1
            assert per_pod == expected
        direct = OpenAI(base_url=f"{homes[ADAPTERS[0]].url}/v1", api_key="unused", max_retries=0)
        same = direct.completions.create(model=ADAPTERS[0], prompt=PROMPT, max_tokens=6, temperature=0)
        assert {same.choices[0].text} == texts[ADAPTERS[0]]  # the router changes nothing in the answer
        # once residency is polled, requests are counted as routed to a pod that holds the adapter
        time.sleep(0.5)
        for adapter in ADAPTERS:
            oai = OpenAI(base_url=f"{routers[0].url}/v1", api_key="unused", max_retries=0)
            oai.completions.create(model=adapter, prompt=PROMPT, max_tokens=2, temperature=0)
        resident = sum(n for (_, tier), n in routers[0].routed().items() if tier in ("device", "host", "disk"))
        assert resident >= len(ADAPTERS)
        text = httpx.get(f"{routers[0].url}/metrics", timeout=5).text
        for adapter in ADAPTERS:  # 2 requests each through this router, each counted under its own name
            assert f'loraplane_router_adapter_requests_total{{adapter="{adapter}"}} 2.0' in text, text
        ratio = next(line for line in text.splitlines() if line.startswith("loraplane_router_resident_ratio "))
        routed = routers[0].routed()
        assert float(ratio.split()[1]) == pytest.approx(resident / sum(routed.values())) and resident >= 6
        assert f"loraplane_router_pods {float(len(pool))}" in text
        for adapter in ADAPTERS:  # the answer names its pod: the adapter's home
            body = {"model": adapter, "prompt": PROMPT, "max_tokens": 1}
            answer = httpx.post(f"{routers[1].url}/v1/completions", json=body, timeout=60)
            assert answer.headers["x-loraplane-pod"] == rank(adapter, POD_NAMES)[0]
    finally:
        for r in routers:
            r.stop()


def test_streams_pass_through_and_a_hang_up_aborts_the_pod_request(pool: list[ServerProcess], tmp_path: Path) -> None:
    router = RouterProcess(pool, tmp_path / "router.log", "--poll-seconds", "0.2")
    try:
        router.wait_ready(len(pool))
        lorax = Client(router.url, timeout=120)
        adapter = ADAPTERS[1]
        whole = lorax.generate(PROMPT, adapter_id=adapter, max_new_tokens=8).generated_text
        streamed = "".join(r.token.text for r in lorax.generate_stream(PROMPT, adapter_id=adapter, max_new_tokens=8))
        assert streamed == whole
        base = lorax.generate(PROMPT, max_new_tokens=4).generated_text  # the base model: any pod
        assert base
        pod = home(adapter, pool)
        before = generated_tokens(pod)
        params = {"adapter_id": adapter, "max_new_tokens": 200, "ignore_eos_token": True}
        with httpx.stream("POST", f"{router.url}/generate_stream", json={"inputs": PROMPT, "parameters": params}) as r:
            assert r.status_code == 200
            next(r.iter_raw())  # the first event, then hang up
        state = wait_idle(pod.url, timeout=30)
        assert state["num_requests"] == 0 and state["num_streams"] == 0, state
        assert generated_tokens(pod) - before < 100  # aborted, not run to its 200 tokens
    finally:
        router.stop()


def generated_tokens(pod: ServerProcess) -> float:
    text = httpx.get(f"{pod.url}/metrics", timeout=10).text
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("loraplane_generation_tokens_total")
    )


def test_admin_routes_are_not_routed(pool: list[ServerProcess], tmp_path: Path) -> None:
    router = RouterProcess(pool, tmp_path / "router.log")
    try:
        router.wait_ready(len(pool))
        r = httpx.post(f"{router.url}/v1/adapters", json={"id": "x", "source": "/tmp"}, headers=admin_headers())
        assert r.status_code == 404 and "per pod" in r.json()["error"]["message"]
        assert httpx.get(f"{router.url}/health").json() == {"status": "ok"}
        models = httpx.get(f"{router.url}/v1/models").json()["data"]  # passed through to a pod
        assert {m["id"] for m in models} >= set(ADAPTERS)
    finally:
        router.stop()


def test_a_pod_that_stops_answering_is_skipped_before_the_first_byte(pool: list[ServerProcess], tmp_path: Path) -> None:
    """The router still lists the stopped pod (it polls once a minute here): its requests are refused at
    connect and go to the next pod in the ranking. Runs last: it stops a pod of the module's pool."""
    router = RouterProcess(pool, tmp_path / "router.log", "--poll-seconds", "60")
    try:
        router.wait_ready(len(pool))
        gone = pool[1]
        orphans = [a for a in ADAPTERS if home(a, pool) is gone]
        assert orphans
        gone.stop()
        oai = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        for adapter in orphans:
            answer = oai.completions.create(model=adapter, prompt=PROMPT, max_tokens=4, temperature=0)
            assert answer.choices[0].text
        assert router.counter("loraplane_router_retries") >= len(orphans)
        assert router.counter("loraplane_router_failures") == 0
    finally:
        router.stop()


def test_a_request_with_no_ready_pod_is_held_until_one_starts(smollm2_dir: Path, tmp_path: Path) -> None:
    """Scale from zero as the router sees it: the pool's one pod is not up; /ready still answers (the router takes
    requests), a request waits and is counted in loraplane_router_held_requests, and once the server has started
    and loaded the model the held request is served by it. Bounded: past --hold-timeout, and beyond --hold-max
    waiting at once, a 503 with Retry-After."""
    port = free_port()
    flags = ["--pod", f"cold=http://127.0.0.1:{port}", "--poll-seconds", "0.2", "--hold-timeout", "180"]
    router = RouterProcess([], tmp_path / "router.log", *flags)
    server: ServerProcess | None = None
    try:
        wait_for(lambda: _get(f"{router.url}/ready"), 60)
        ready = httpx.get(f"{router.url}/ready", timeout=5)
        assert ready.status_code == 200 and ready.json() == {"status": "holding: no Ready server pod", "pods": []}
        answers: list[httpx.Response] = []
        body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        client = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{router.url}/v1/completions", json=body, timeout=240))
        )
        client.start()
        wait_for(lambda: router.gauge("loraplane_router_held_requests") == 1, 30)
        server = ServerProcess([], tmp_path / "pod.log", port=port)
        server.wait_ready()
        client.join(240)
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-loraplane-pod"] == "cold" and answer.json()["choices"][0]["text"]
        assert router.gauge("loraplane_router_held_requests") == 0
        assert router.gauge("loraplane_router_held_seconds_count") == 1
    finally:
        router.stop()
        if server is not None:
            server.stop()

    # bounded: one waits (then times out), the next is refused at once
    flags = ["--pod", f"gone=http://127.0.0.1:{free_port()}", "--hold-timeout", "2", "--hold-max", "1"]
    router = RouterProcess([], tmp_path / "router2.log", *flags)
    try:
        wait_for(lambda: _get(f"{router.url}/ready"), 60)
        first: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: first.append(httpx.post(f"{router.url}/v1/completions", json=body, timeout=30))
        )
        started = time.monotonic()
        client.start()
        wait_for(lambda: router.gauge("loraplane_router_held_requests") == 1, 10)
        full = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert full.status_code == 503 and "already wait" in full.json()["error"]["message"]
        assert int(full.headers["retry-after"]) >= 1
        client.join(30)
        assert first[0].status_code == 503 and "within 2 s" in first[0].json()["error"]["message"]
        assert first[0].headers["retry-after"] and time.monotonic() - started >= 2
        assert router.gauge('loraplane_router_failures_total{reason="hold_full"}') == 1
        assert router.gauge('loraplane_router_failures_total{reason="hold_timeout"}') == 1
    finally:
        router.stop()


def _get(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.1)
