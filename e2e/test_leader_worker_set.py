"""A vLLM server across several nodes (`engine.kind: vllm`, `engine.nodes` > 1) on the real API server: the
upstream LeaderWorkerSet CRD of a pinned release (sigs.k8s.io/lws, from the Go module cache through the Go module
proxy, as the control plane's modules), applied and Established; the LeaderWorkerSet the operator builds for the
chart's 70B example on 2 nodes is created with strict field validation and read back (groups, size, the leader's
server labels and model fetch, Ray on the workers); a single-node vLLM Deployment and the chart's BaseModelServer
for it pass a server-side dry run. No LeaderWorkerSet controller runs here (a cluster installs it), so no pods
start: the vLLM pods themselves run in `make e2e-vllm`. The namespace and the CRD are deleted at the end."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.helm import CHART
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import install_crds
from loraplane_operator import builders, vllm_builders
from loraplane_operator import constants as c

pytestmark = pytest.mark.e2e

LWS_MODULE = "sigs.k8s.io/lws"
LWS_VERSION = "v0.8.0"
CRD_FILE = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
NAMESPACE = "e2e-lws"
EXAMPLE = CHART / "examples" / "vllm-values.yaml"


def upstream_crd(work: Path) -> Path:
    """The LeaderWorkerSet CRD of LWS_VERSION in the Go module cache (downloaded on the first run only)."""
    if shutil.which("go") is None:
        pytest.skip("Go is not available: it fetches the LeaderWorkerSet CRD from the Go module proxy")
    env = {**os.environ, "GOFLAGS": ""}
    argv = ["go", "mod", "download", "-json", f"{LWS_MODULE}@{LWS_VERSION}"]
    result = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    info = json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}
    if result.returncode != 0 or not info.get("Dir"):
        pytest.skip(f"{' '.join(argv)} failed: {info.get('Error') or result.stderr.strip()[-500:]}")
    crd = Path(info["Dir"]) / CRD_FILE
    assert crd.is_file(), crd
    return crd


def example_server(nodes: int) -> dict[str, Any]:
    """The BaseModelServer the chart's vLLM example describes, on `nodes` nodes."""
    values = yaml.safe_load(EXAMPLE.read_text())["server"]
    spec = {k: copy.deepcopy(v) for k, v in values.items() if k not in ("enabled", "router")}
    spec["engine"]["nodes"] = nodes
    return {"apiVersion": c.API_VERSION, "kind": c.BMS_KIND, "metadata": {"name": "llama", "namespace": NAMESPACE},
            "spec": spec}  # fmt: skip


def established(kubectl: Kubectl) -> bool:
    """The CRD's Established condition (kubectl wait fails on a CRD whose status is not written yet)."""
    conditions = (kubectl.json("get", "crd", CRD_NAME).get("status") or {}).get("conditions") or []
    return any(x["type"] == "Established" and x["status"] == "True" for x in conditions)


@pytest.fixture(scope="module")
def kube(kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubectl]:
    work = Path(tmp_path_factory.mktemp("lws"))
    crd = upstream_crd(work)
    install_crds(kubectl)
    try:
        kubectl("apply", "--server-side", "-f", str(crd))  # too big for the last-applied annotation
        wait_until(lambda: established(kubectl), timeout=60, what=f"crd/{CRD_NAME} Established")
        kubectl("create", "namespace", NAMESPACE)
        yield kubectl
    finally:
        kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false")
        kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--timeout=60s")


def create(kubectl: Kubectl, manifest: dict[str, Any], *extra: str) -> str:
    return kubectl("create", "--validate=strict", "-n", NAMESPACE, *extra, "-f", "-", input=json.dumps(manifest))


def test_the_operators_leader_worker_set_is_accepted_as_built(kube: Kubectl) -> None:
    bms = example_server(nodes=2)
    create(kube, bms, "--dry-run=server")  # the BaseModelServer itself passes the CRD's rules
    lws = vllm_builders.get_workload(bms)
    assert lws["kind"] == "LeaderWorkerSet"
    create(kube, lws)
    live = kube.json("get", "leaderworkerset", "llama", "-n", NAMESPACE)
    template = live["spec"]["leaderWorkerTemplate"]
    assert (live["spec"]["replicas"], template["size"]) == (2, 2)
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert (
        leader["metadata"]["labels"][c.SERVER_LABEL] == "llama" and c.SERVER_LABEL not in worker["metadata"]["labels"]
    )
    assert leader["spec"]["initContainers"][0]["command"] == ["loraplane", "pull"]
    assert "--pipeline-parallel-size 2" in leader["spec"]["containers"][0]["command"][-1]
    assert "ray start --address" in worker["spec"]["containers"][0]["command"][-1]
    assert worker["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_a_field_the_crd_does_not_know_is_refused(kube: Kubectl) -> None:
    """Strict validation has teeth here: a misspelt field in the LeaderWorkerSet is refused, so the test above
    proves every field we write is one the LeaderWorkerSet API has."""
    lws = vllm_builders.get_workload(example_server(nodes=2))
    lws["metadata"]["name"] = "typo"
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(KubectlError, match="sizee"):
        create(kube, lws)


def test_a_single_node_vllm_server_is_a_deployment_the_api_server_accepts(kube: Kubectl) -> None:
    bms = example_server(nodes=1)
    create(kube, bms, "--dry-run=server")
    deployment = vllm_builders.get_workload(bms)
    assert (deployment["kind"], builders.workload_kind(bms["spec"])) == ("Deployment", ("apps/v1", "Deployment"))
    create(kube, deployment, "--dry-run=server")
