"""Helpers for the operator e2e tests: the operator as a subprocess under its chart's RBAC, manifests for a
small BaseModelServer on the process kubelet, and calls to the server pods' HTTP API."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
import yaml

from e2e.cluster import REPO_ROOT, LocalCluster
from e2e.kubectl import Kubectl, KubectlError
from e2e.process import spawn, stop
from loraplane_operator.constants import ADMIN_TOKEN_ENV, DEFAULT_ADMIN_PORT

CRD_DIR = REPO_ROOT / "crds"
SAMPLES_DIR = CRD_DIR / "samples"
ADAPTERS_DIR = REPO_ROOT / "server" / "examples" / "adapters"
ADAPTER_NAMES = ("french", "pirate", "json")
OPERATOR_NAMESPACE = "loraplane-system"
OPERATOR_ACCOUNT = "loraplane-operator"
SERVER_LABEL = "loraplane.dev/server"
FINALIZER = "loraplane.dev/finalizer"
GROUP = "loraplane.dev"


# the operator


class OperatorProcess:
    """`run_operator()` in a child process with KUBECONFIG pointing to a ServiceAccount's kubeconfig."""

    def __init__(self, kubeconfig: Path, log_path: Path) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "the operator is running"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        code = "from loraplane_operator.main import run_operator; run_operator()"
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n===== operator start #{self.starts} =====\n")
        self.process = spawn([sys.executable, "-c", code], self.log_path, env=env, cwd=REPO_ROOT)

    def wait_started(self, timeout: float = 90.0) -> None:
        """Until kopf has logged in (its watches start right after); raises with the log if the process exits."""
        deadline = time.monotonic() + timeout
        marker = "Initial authentication has finished"
        while self.log().split(f"operator start #{self.starts} ")[-1].count(marker) == 0:
            if not self.is_running:
                raise RuntimeError(
                    f"the operator exited with {self.process and self.process.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the operator did not start within {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no cleanup handlers, no last status writes (a crash or an OOM kill)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process, grace_seconds=15.0)

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-num_lines:])


def install_crds(kubectl: Kubectl) -> None:
    """The project's CRDs (crds/*.yaml; samples/ is a subdirectory, not applied), once they are Established."""
    kubectl("apply", "-f", str(CRD_DIR))
    for crd in ("basemodelservers.loraplane.dev", "loraadapters.loraplane.dev"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


def install_operator_rbac(kubectl: Kubectl, cluster: LocalCluster) -> Path:
    """ServiceAccount + the chart's ClusterRole (loraplane_operator.rbac) + binding; the account's kubeconfig."""
    from loraplane_operator.rbac import cluster_role

    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}})
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_ACCOUNT}}
    kubectl.apply(account, OPERATOR_NAMESPACE)
    role = cluster_role(OPERATOR_ACCOUNT)
    kubectl.apply(role)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": OPERATOR_ACCOUNT},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT, "namespace": OPERATOR_NAMESPACE}],
    }
    kubectl.apply(binding)
    return cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, expiration_seconds=7200)


def rbac_rules_from_yaml() -> list[dict[str, Any]]:
    path = REPO_ROOT / "operator" / "loraplane_operator" / "rbac_rules.yaml"
    return list(yaml.safe_load(path.read_text()))


# manifests


def load_sample(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((SAMPLES_DIR / name).read_text()))


def snapshot_adapters(dest: Path) -> Path:
    """Copies of the example adapters (others may rewrite server/examples while the tests run); an adapter
    missing there is made with PEFT (random weights, tests/lora_helpers.py)."""
    dest.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(ADAPTER_NAMES):
        src = ADAPTERS_DIR / name
        files = ("adapter_config.json", "adapter_model.safetensors")
        if all((src / f).is_file() for f in files):
            shutil.copytree(src, dest / name, dirs_exist_ok=True)
            continue
        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from lora_helpers import make_peft_adapter  # type: ignore[import-not-found]
        from loraplane_server.store.builtin import resolve_model

        targets = ["q_proj", "v_proj"]
        make_peft_adapter(
            resolve_model("smollm2-135m"), dest / name, seed=100 + seed, r=4, lora_alpha=8, target_modules=targets
        )
    return dest


def local_server_sample(adapters_dir: Path, replicas: int = 2) -> dict[str, Any]:
    """The sample BaseModelServer, made to run on the process kubelet: the venv's python as the command, a
    small engine, no GPU, the example adapters' directory allowed, a per-pod disk cache in the pod dir."""
    bms = copy.deepcopy(load_sample("loraplane.dev_v1alpha1_basemodelserver.yaml"))
    spec = bms["spec"]
    spec["replicas"] = replicas
    spec["command"] = [sys.executable, "-m", "loraplane_server.serving.cli", "serve"]
    spec["resources"] = {"gpus": 0}  # --device cpu: with a GPU the operator passes --device cuda, failing here
    spec["engine"] = {
        "maxLoras": 4,
        "maxLoraRank": 64,
        "maxNumSeqs": 4,
        "maxNumBatchedTokens": 512,
        "kvCacheGiB": 0.05,
        "hostCacheBytes": "256MiB",
        "diskCacheBytes": "256MiB",
        "dtype": "float32",
        "maxQueue": 64,
    }
    spec["adapterSourceAllow"] = [str(adapters_dir)]
    spec["args"] = ["--disk-cache-dir", "adapter-disk-cache"]  # relative: the pod's own directory
    # the process kubelet shares one file system and would re-point every /tmp path of the test (the adapters'
    # snapshot) at the pod's /tmp volume; the read-only default's admission is checked in test_operator (b)
    spec["pod"] = {"readOnlyRootFilesystem": False}
    return bms


RESTRICTED_NAMESPACE = "e2e-pod-security-restricted"


def pod_security_verdict(kubectl: Kubectl, pod_spec: dict[str, Any], name: str) -> str:
    """Ask the API server's own PodSecurity admission whether a namespace enforcing `restricted` admits a pod with
    this spec (a server-side dry run: nothing is created). '' if admitted, else the refusal."""
    try:
        kubectl("get", "namespace", RESTRICTED_NAMESPACE)
    except KubectlError:
        kubectl("create", "namespace", RESTRICTED_NAMESPACE)
        kubectl("label", "namespace", RESTRICTED_NAMESPACE, "pod-security.kubernetes.io/enforce=restricted")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": pod_spec}
    try:
        kubectl("create", "--dry-run=server", "-n", RESTRICTED_NAMESPACE, "-f", "-", input=json.dumps(pod))
    except KubectlError as exc:
        return str(exc)
    return ""


def local_adapter_sample(name: str, adapters_dir: Path) -> dict[str, Any]:
    """A sample LoRAAdapter with its source pointed at the real example adapter, prewarmed on every pod."""
    lora = copy.deepcopy(load_sample(f"loraplane.dev_v1alpha1_loraadapter_{name}.yaml"))
    lora["spec"]["source"] = str(adapters_dir / name)
    prewarm = lora["spec"].setdefault("prewarm", {})
    prewarm.pop("replicas", None)
    if prewarm.get("tier") not in ("device", "host"):
        prewarm["tier"] = "device"
    return lora


def adapter_manifest(name: str, server: str, source: str, tier: str = "host") -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {"baseModelServer": server, "source": source, "prewarm": {"tier": tier}},
    }


# reading the cluster


def is_ready(obj: dict[str, Any]) -> bool:
    conditions = obj.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def server_pods(kubectl: Kubectl, namespace: str, server: str) -> list[dict[str, Any]]:
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", f"{SERVER_LABEL}={server}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready_server_pods(kubectl: Kubectl, namespace: str, server: str) -> list[dict[str, Any]]:
    return [p for p in server_pods(kubectl, namespace, server) if is_ready(p)]


def pid_of(pod: dict[str, Any]) -> int:
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("process://"), container_id
    return int(container_id.removeprefix("process://"))


def restart_count(pod: dict[str, Any]) -> int:
    return sum(int(s.get("restartCount") or 0) for s in pod.get("status", {}).get("containerStatuses") or [])


# the server pods' HTTP API


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False
    return session


ADMIN_PORT = DEFAULT_ADMIN_PORT  # the server pods' admin routes (--admin-port): /v1/adapters answers only there


def pod_url(pod: dict[str, Any], port: int = 8080) -> str:
    return f"http://{pod['status']['podIP']}:{port}"


def admin_headers(pod: dict[str, Any]) -> dict[str, str]:
    """The pod's admin token as a bearer header, read from its process's environment (what `kubectl exec -- env`
    shows): the operator generates one for every server without adminTokenSecretRef, so no admin call is open."""
    environ = Path(f"/proc/{pid_of(pod)}/environ").read_bytes().split(b"\0")
    values = dict(item.decode(errors="replace").partition("=")[::2] for item in environ if b"=" in item)
    token = values.get(ADMIN_TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


def list_adapters(pod: dict[str, Any]) -> list[dict[str, Any]]:
    with _session() as session:
        response = session.get(f"{pod_url(pod, ADMIN_PORT)}/v1/adapters", headers=admin_headers(pod), timeout=10)
    response.raise_for_status()
    return list(response.json()["data"])


def adapter_rows(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in list_adapters(pod)}


def complete(pod: dict[str, Any], model: str, prompt: str, max_tokens: int = 12) -> str:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with _session() as session:
        response = session.post(f"{pod_url(pod)}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, f"{model} on {pod['metadata']['name']}: {response.status_code} {response.text}"
    return str(response.json()["choices"][0]["text"])


def http_status(url: str) -> int:
    with _session() as session:
        return session.get(url, timeout=5).status_code


# diagnostics


def diagnostics(kubectl: Kubectl, cluster: LocalCluster, operator: OperatorProcess | None, namespace: str) -> str:
    """Operator log tail, the custom resources, and each server pod's log tail: printed when a test fails."""
    parts: list[str] = []
    if operator is not None:
        parts.append(f"--- operator (running={operator.is_running}) ---\n{operator.log_tail(120)}")
    for args in (
        ("get", "bms,lora,deploy,rs,pods,svc", "-n", namespace, "-o", "wide"),
        ("get", "lora", "-n", namespace, "-o", "yaml"),
        ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
    ):
        try:
            parts.append(f"--- kubectl {' '.join(args)} ---\n{kubectl(*args)}")
        except Exception as error:  # noqa: BLE001 - diagnostics must not fail
            parts.append(f"--- kubectl {' '.join(args)}: {error}")
    try:
        pods = kubectl.json("get", "pods", "-n", namespace)["items"]
    except Exception:  # noqa: BLE001
        pods = []
    for pod in pods:
        name = pod["metadata"]["name"]
        log = "\n".join(cluster.pod_log(namespace, name, "server").splitlines()[-40:])
        parts.append(f"--- pod {name} (server.log tail) ---\n{log}")
    parts.append(f"--- kubelet ---\n{cluster.log_tail('kubelet', 40)}")
    return "\n".join(parts)


# reference outputs


def reference_greedy(adapters: dict[str, Path], prompt: str, max_tokens: int) -> tuple[list[int], dict[str, str]]:
    """(prompt token ids, name -> greedy text): transformers + PEFT in this process, fp32, one request at a
    time, on the built-in model's weights. "smollm2-135m" is the base model without an adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplane_server.store.builtin import resolve_model

    base_dir = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    texts: dict[str, str] = {}
    for name, adapter_dir in {"smollm2-135m": None, **adapters}.items():
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        texts[name] = str(tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True))
        del model
    return ids, texts


def complete_ids(pod: dict[str, Any], model: str, prompt_ids: list[int], max_tokens: int) -> str:
    """/v1/completions with a token-id prompt (no tokenizer differences), greedy; the generated text."""
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    with _session() as session:
        response = session.post(f"{pod_url(pod)}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, f"{model} on {pod['metadata']['name']}: {response.status_code} {response.text}"
    return str(response.json()["choices"][0]["text"])


# model sources (issue 19)


def builtin_model_dir() -> Path:
    """The built-in model's converted safetensors directory (what the S3 tests upload)."""
    from loraplane_server.store.builtin import resolve_model

    return Path(resolve_model("smollm2-135m"))


def s3_credentials_secret(name: str, access_key: str, secret_key: str) -> dict[str, Any]:
    """A Secret with S3 keys under the names spec.credentials.s3 reads by default."""
    data = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque", "stringData": data}


def s3_model_server(
    name: str, adapters_dir: Path, model: str, secret: str, endpoint: str, replicas: int
) -> dict[str, Any]:
    """The local sample BaseModelServer serving `model` from S3, its keys from `secret`, the store at `endpoint`."""
    bms = local_server_sample(adapters_dir, replicas)
    bms["metadata"]["name"] = name
    bms["spec"]["model"] = model
    bms["spec"]["credentials"] = {"s3": {"secretName": secret, "endpoint": endpoint, "region": "us-east-1"}}
    return bms
