"""Issue 19 end to end: a BaseModelServer whose base model lives in S3 (a real MinIO on loopback), two replicas
sharing one cache claim that the operator creates and the process kubelet's local-path provisioner binds
through the real PV controller; credentials from a Secret; the model's status going Downloading -> Ready;
a wrong source ending Failed with the reason; and the S3 model answering as the built-in model does.

One namespace and one operator for the module; the tests run in order (a: the S3 model, b: a wrong source,
c: a request through a pod)."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from e2e.api import ApiClient
from e2e.cluster import LocalCluster
from e2e.kubectl import Kubectl, wait_until
from e2e.operator_fixtures import (
    OperatorProcess,
    builtin_model_dir,
    complete_ids,
    diagnostics,
    install_crds,
    install_operator_rbac,
    local_adapter_sample,
    pod_url,
    ready_server_pods,
    reference_greedy,
    s3_credentials_secret,
    s3_model_server,
    server_pods,
    snapshot_adapters,
)

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-model-sources"
SERVER = "smollm2-s3"
MISSING = "missing-model"
SECRET = "model-store"
BUCKET, PREFIX = "models", "smollm2"
ADAPTER = "french"
PROMPT = "The capital of France is"
MAX_TOKENS = 10
POD_START_S = 300.0  # a download, then two pods loading the model on 2 shared cores
# The S3 endpoint the pods use is a proxy that sends at most this many bytes per second, so the download
# lasts about 25 s and the operator's status timer (10 s) sees it: Downloading must be observed, not guessed.
THROTTLE_BYTES_PER_S = 20 * 1024 * 1024


class ThrottledProxy(socketserver.ThreadingTCPServer):
    """A TCP proxy on loopback to `target` whose answers, over all connections together, stay under a byte rate
    (a slow network; the S3 requests and their signatures pass through unchanged)."""

    daemon_threads = True

    def __init__(self, target: tuple[str, int], bytes_per_s: int) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.target = target
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._next_send = time.monotonic()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def pace(self, num_bytes: int) -> None:
        """Sleeps until these bytes fit the rate (one schedule shared by every connection)."""
        with self._lock:
            start = max(self._next_send, time.monotonic())
            self._next_send = start + num_bytes / self.bytes_per_s
        time.sleep(max(0.0, start - time.monotonic()))


class _ProxyHandler(socketserver.BaseRequestHandler):
    server: ThrottledProxy

    def handle(self) -> None:
        with socket.create_connection(self.server.target) as upstream:
            up = threading.Thread(target=_pump, args=(self.request, upstream, None), daemon=True)
            up.start()
            _pump(upstream, self.request, self.server)
            up.join(5)


def _pump(src: socket.socket, dst: socket.socket, throttle: ThrottledProxy | None) -> None:
    try:
        while chunk := src.recv(65536):
            if throttle is not None:
                throttle.pace(len(chunk))
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class PhaseRecorder:
    """Watches the namespace's BaseModelServers and records each one's status.model phases in order (and its
    status.draftModel's, under "<name>/draft")."""

    def __init__(self, api: ApiClient, namespace: str) -> None:
        self.api = api
        self.path = f"/apis/loraplane.dev/v1alpha1/namespaces/{namespace}/basemodelservers"
        self.phases: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bms-phases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _record(self, bms: dict[str, Any]) -> None:
        status = bms.get("status") or {}
        for key, suffix in (("model", ""), ("draftModel", "/draft")):
            phase = (status.get(key) or {}).get("phase")
            seen = self.phases.setdefault(bms["metadata"]["name"] + suffix, [])
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.api.get(self.path)
                for item in listing["items"]:
                    self._record(item)
                for event in self.api.watch(self.path, listing["metadata"]["resourceVersion"], timeout_seconds=60):
                    if self._stop.is_set() or event["type"] == "ERROR":
                        break
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._record(event["object"])
            except Exception:  # noqa: BLE001 - a watch that breaks is started again
                self._stop.wait(0.5)


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    operator: OperatorProcess
    minio: Any  # tests/s3_server.py's MinioServer
    proxy: ThrottledProxy
    recorder: PhaseRecorder
    adapters_dir: Path
    model_bytes: int
    namespace: str = NAMESPACE
    bytes_sent_before: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def get(self, *args: str) -> Any:
        return self.kubectl.json("get", *args, "-n", self.namespace)

    def bms(self, name: str) -> dict[str, Any]:
        return dict(self.get("bms", name))

    def model(self, name: str) -> dict[str, Any]:
        return dict((self.bms(name).get("status") or {}).get("model") or {})


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, cluster: LocalCluster, minio: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    install_crds(kubectl)
    model_dir = builtin_model_dir()
    minio.upload_dir(model_dir, BUCKET, PREFIX)
    model_bytes = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    kubeconfig = install_operator_rbac(kubectl, cluster)
    work = Path(tmp_path_factory.mktemp("model-sources"))
    operator = OperatorProcess(kubeconfig, work / "operator.log")
    kubectl("create", "namespace", NAMESPACE)
    kubectl.apply(s3_credentials_secret(SECRET, minio.access_key, minio.secret_key), NAMESPACE)
    host, port = minio.endpoint.removeprefix("http://").split(":")
    proxy = ThrottledProxy((host, int(port)), THROTTLE_BYTES_PER_S)
    threading.Thread(target=proxy.serve_forever, name="s3-proxy", daemon=True).start()
    recorder = PhaseRecorder(ApiClient.from_kubeconfig(cluster.kubeconfig), NAMESPACE)
    recorder.start()
    adapters_dir = snapshot_adapters(work / "adapters")
    environment = Env(kubectl, cluster, operator, minio, proxy, recorder, adapters_dir, model_bytes)
    operator.start()
    try:
        operator.wait_started()
        yield environment
    finally:
        _teardown(environment)


def _teardown(env: Env) -> None:
    env.recorder.stop()
    try:
        env.kubectl("delete", "lora", "--all", "-n", env.namespace, "--wait=false")
        wait_until(lambda: not env.get("lora")["items"], timeout=60, what="adapters deleted")
    except Exception:  # noqa: BLE001 - never leave the namespace stuck on the adapters' finalizers
        for item in env.get("lora")["items"]:
            patch = json.dumps({"metadata": {"finalizers": None}})
            env.kubectl("patch", "lora", item["metadata"]["name"], "-n", env.namespace, "--type=merge", "-p", patch)
    finally:
        env.operator.stop()
        env.proxy.shutdown()
        env.proxy.server_close()
        env.kubectl("delete", "namespace", env.namespace, "--wait=false")


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, env: Env) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        text = diagnostics(env.kubectl, env.cluster, env.operator, env.namespace)
        text += f"\n--- model phases seen ---\n{env.recorder.phases}\n--- minio log ---\n{env.minio.log()}"
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n===== diagnostics after {request.node.name} =====\n{text}")


def _adapter_ready_on(env: Env, pods: list[str]) -> bool:
    status = env.get("lora", ADAPTER).get("status") or {}
    resident = sorted(e["pod"] for e in status.get("residency") or [] if e.get("state") == "ready")
    return status.get("phase") == "Ready" and resident == pods


def _both_ready(env: Env) -> list[dict[str, Any]] | None:
    pods = ready_server_pods(env.kubectl, env.namespace, SERVER)
    if len(pods) != 2 or len(server_pods(env.kubectl, env.namespace, SERVER)) != 2:
        return None
    return pods if env.model(SERVER).get("phase") == "Ready" else None


# a. an S3 model, two replicas, one shared cache claim, one download


def test_a_s3_model_downloads_once_into_a_shared_claim(env: Env) -> None:
    env.bytes_sent_before = env.minio.sent_bytes()
    bms = s3_model_server(SERVER, env.adapters_dir, f"s3://{BUCKET}/{PREFIX}", SECRET, env.proxy.endpoint, 2)
    bms["spec"]["modelCache"] = {"volume": "PersistentVolumeClaim", "size": "2Gi"}
    # a draft model from the same prefix: its own status, served from the entry the model's download filled
    bms["spec"].setdefault("engine", {})["draftModel"] = f"s3://{BUCKET}/{PREFIX}"
    env.kubectl.apply(bms, env.namespace)
    lora = local_adapter_sample(ADAPTER, env.adapters_dir)
    lora["spec"]["baseModelServer"] = SERVER
    env.kubectl.apply(lora, env.namespace)

    pods = wait_until(lambda: _both_ready(env), timeout=POD_START_S, what=f"{SERVER}: 2 pods and the model Ready")
    sent = env.minio.sent_bytes() - env.bytes_sent_before

    # the status went Downloading -> Ready (Loading may be seen between), never Failed
    phases = env.recorder.phases.get(SERVER, [])
    assert "Downloading" in phases and phases[-1] == "Ready", phases
    assert phases.index("Downloading") < phases.index("Ready") and "Failed" not in phases, phases
    model = env.model(SERVER)
    assert model["source"] == f"s3://{BUCKET}/{PREFIX}" and model.get("bytesTotal") in (None, env.model_bytes)
    conditions = {c["type"]: c for c in env.bms(SERVER)["status"]["conditions"]}
    assert conditions["ModelReady"]["status"] == "True"
    draft_phases = env.recorder.phases.get(f"{SERVER}/draft", [])
    draft = env.bms(SERVER)["status"]["draftModel"]
    assert draft["source"] == f"s3://{BUCKET}/{PREFIX}" and draft["phase"] == "Ready", draft
    assert draft_phases[-1] == "Ready" and "Failed" not in draft_phases, draft_phases

    # one download for two pods and the draft (the same files): MinIO sent one copy (plus listings and headers)
    assert env.model_bytes <= sent < 1.5 * env.model_bytes, f"MinIO sent {sent} bytes for a {env.model_bytes} model"

    # the claim the operator created, bound through the PV controller to the node's local-path volume
    claim = env.get("pvc", f"{SERVER}-model-cache")
    assert claim["status"]["phase"] == "Bound"
    assert [o["kind"] for o in claim["metadata"]["ownerReferences"]] == ["BaseModelServer"]
    volume = env.kubectl.json("get", "pv", claim["spec"]["volumeName"])
    weights = list(Path(volume["spec"]["hostPath"]["path"]).rglob("model.safetensors"))
    assert len(weights) == 1, weights  # one copy in the shared cache, no half-written leftovers beside it
    for pod in pods:
        assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]

    # the printer columns
    table = env.kubectl("get", "bms", SERVER, "-n", env.namespace)
    header, row = table.splitlines()[:2]
    assert "MODEL-STATUS" in header.split() and "MODEL" in header.split()
    assert f"s3://{BUCKET}/{PREFIX}" in row.split() and "Ready" in row.split(), table
    wide = env.kubectl("get", "bms", SERVER, "-n", env.namespace, "-o", "wide").splitlines()
    assert "DOWNLOADED" in wide[0] and "DRAFT-STATUS" in wide[0], wide
    column = wide[0].index("DRAFT-STATUS")  # kubectl aligns a column's values under its header
    assert wide[1][column:].split()[0] == "Ready", wide

    # the adapter is prewarmed on both pods; credentials never reach the spec or the status
    names = sorted(p["metadata"]["name"] for p in pods)
    wait_until(lambda: _adapter_ready_on(env, names), timeout=180, what=f"{ADAPTER} Ready on {names}")
    dumped = json.dumps([env.bms(SERVER), env.get("deploy", SERVER)])
    assert env.minio.secret_key not in dumped and env.minio.access_key not in dumped
    env.notes["pods"] = pods
    print(f"{SERVER}: phases {phases}, the draft's {draft_phases}")
    print(f"{SERVER}: MinIO sent {sent} bytes for a {env.model_bytes}-byte model")


# b. a wrong source ends Failed with the reason, and no pod serves


def test_b_wrong_source_ends_failed_with_the_reason(env: Env) -> None:
    bms = s3_model_server(MISSING, env.adapters_dir, f"s3://{BUCKET}/does-not-exist", SECRET, env.proxy.endpoint, 1)
    env.kubectl.apply(bms, env.namespace)
    started = time.monotonic()
    model = wait_until(
        lambda: (m := env.model(MISSING)).get("phase") == "Failed" and m,
        timeout=180,
        what=f"{MISSING}: status.model Failed",
    )
    elapsed = time.monotonic() - started
    reason = str(model.get("reason", ""))
    assert "s3://models/does-not-exist" in reason and "no objects" in reason, model
    assert reason in str(model.get("message", "")), model
    conditions = {c["type"]: c for c in env.bms(MISSING)["status"]["conditions"]}
    assert conditions["ModelReady"]["status"] == "False" and reason in conditions["ModelReady"]["message"]
    assert conditions["Ready"]["status"] == "False"
    assert env.recorder.phases[MISSING][-1] == "Failed" and "Ready" not in env.recorder.phases[MISSING]

    # the server exits with the reason as its last log line, which the kubelet puts in the container's
    # termination message (FallbackToLogsOnError); the status stays Failed once the reason comes from there
    terminated = wait_until(lambda: _terminated_message(env, MISSING), timeout=60, what=f"{MISSING} terminated")
    assert terminated.rstrip().endswith(f"loraplane: failed to start: {reason}"), terminated
    assert "Traceback" not in terminated
    assert ready_server_pods(env.kubectl, env.namespace, MISSING) == []
    assert env.model(MISSING)["phase"] == "Failed" and env.model(MISSING)["reason"] == reason
    assert env.minio.secret_key not in json.dumps(env.bms(MISSING))
    env.kubectl("delete", "bms", MISSING, "-n", env.namespace, "--wait=false")
    print(f"{MISSING}: Failed after {elapsed:.0f}s: {reason}")


def _terminated_message(env: Env, server: str) -> str | None:
    for pod in server_pods(env.kubectl, env.namespace, server):
        for status in pod["status"].get("containerStatuses") or []:
            terminated = status["state"].get("terminated") or status.get("lastState", {}).get("terminated")
            if terminated and terminated.get("message"):
                return str(terminated["message"])
    return None


# c. the S3 model answers as the built-in model does


def test_c_s3_model_answers_as_the_builtin_model(env: Env) -> None:
    pods = env.notes.get("pods") or ready_server_pods(env.kubectl, env.namespace, SERVER)
    assert len(pods) == 2, "scenario a did not leave two ready pods"
    prompt_ids, expected = reference_greedy({ADAPTER: env.adapters_dir / ADAPTER}, PROMPT, MAX_TOKENS)
    assert expected[ADAPTER] != expected["smollm2-135m"], expected
    base = _base_model_id(pods[0])
    for pod in pods:
        assert complete_ids(pod, base, prompt_ids, MAX_TOKENS) == expected["smollm2-135m"]
        assert complete_ids(pod, ADAPTER, prompt_ids, MAX_TOKENS) == expected[ADAPTER]


def _base_model_id(pod: dict[str, Any]) -> str:
    import requests

    with requests.Session() as session:
        session.trust_env = False
        models = session.get(f"{pod_url(pod)}/v1/models", timeout=10).json()["data"]
    return str(next(m["id"] for m in models if m.get("parent") is None))
