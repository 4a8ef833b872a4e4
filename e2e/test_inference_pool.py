"""The chart's InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) on the real API
server: the upstream CRD of a pinned release, from the Go module cache (`go mod download`, through the Go module
proxy like the control plane's modules), applied and Established; the pool `helm template` renders is created
with strict field validation and read back with the server pods' selector, the server port and the endpoint
picker; pools with a bad failureMode, no targetPorts or no picker port are refused by the CRD's schema and CEL
rules. The namespace and the CRD are deleted at the end."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.helm import CHART, Helm
from e2e.kubectl import Kubectl, KubectlError
from loraplane_operator import builders

pytestmark = pytest.mark.e2e

GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GIE_VERSION = "v1.2.0"
CRD_FILE = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
CRD_NAME = "inferencepools.inference.networking.k8s.io"
API_VERSION = "inference.networking.k8s.io/v1"
NAMESPACE = "e2e-inference-pool"
RELEASE = "lp"
SERVER = "smollm2"
PORT = 8123
PICKER = "smollm2-epp"


def upstream_crd(work: Path) -> Path:
    """The InferencePool CRD of GIE_VERSION in the Go module cache (downloaded on the first run only)."""
    if shutil.which("go") is None:
        pytest.skip("Go is not available: it fetches the InferencePool CRD from the Go module proxy")
    env = {**os.environ, "GOFLAGS": ""}  # as e2e/build_control_plane.sh runs `go mod download`
    argv = ["go", "mod", "download", "-json", f"{GIE_MODULE}@{GIE_VERSION}"]
    result = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    info = json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}
    if result.returncode != 0 or not info.get("Dir"):
        pytest.skip(f"{' '.join(argv)} failed: {info.get('Error') or result.stderr.strip()[-500:]}")
    crd = Path(info["Dir"]) / CRD_FILE
    assert crd.is_file(), crd
    return crd


def chart_pool(helm: Helm, work: Path) -> dict[str, Any]:
    """The one InferencePool the chart renders for a server on PORT with the pool enabled."""
    picker = {"name": PICKER, "failureMode": "FailOpen"}
    server = {
        "enabled": True,
        "name": SERVER,
        "port": PORT,
        "inferencePool": {"enabled": True, "endpointPickerRef": picker},
    }
    values = work / "values.yaml"
    values.write_text(yaml.safe_dump({"server": server}))
    docs = [
        d for d in yaml.safe_load_all(helm("template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values))) if d
    ]
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    return dict(pool)


@dataclass
class Env:
    kubectl: Kubectl
    pool: dict[str, Any]

    def create(self, manifest: dict[str, Any]) -> str:
        return self.kubectl("create", "--validate=strict", "-n", NAMESPACE, "-f", "-", input=json.dumps(manifest))

    def get(self, name: str) -> dict[str, Any]:
        return dict(self.kubectl.json("get", "inferencepool", name, "-n", NAMESPACE))


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, helm: Helm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = Path(tmp_path_factory.mktemp("inference-pool"))
    crd = upstream_crd(work)
    pool = chart_pool(helm, work)
    try:
        kubectl("apply", "-f", str(crd))
        kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
        kubectl("create", "namespace", NAMESPACE)
        yield Env(kubectl, pool)
    finally:
        kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false")
        kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--timeout=60s")


def test_upstream_crd_is_the_pinned_v1(env: Env) -> None:
    crd = env.kubectl.json("get", "crd", CRD_NAME)
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_VERSION
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [("v1", True, True)]
    assert env.pool["apiVersion"] == API_VERSION


def test_chart_pool_created_with_the_server_selector_and_port(env: Env) -> None:
    """Created for real (strict field validation: no field the CRD does not know) and read back as stored, with
    the CRD's defaults filled in by the API server."""
    env.create(env.pool)
    stored = env.get(SERVER)
    spec = stored["spec"]
    assert spec["selector"] == {"matchLabels": builders.selector_labels(SERVER)}
    assert spec["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "loraplane-server",
        "loraplane.dev/server": SERVER,
    }
    assert spec["targetPorts"] == [{"number": PORT}]
    picker = spec["endpointPickerRef"]
    assert (picker["name"], picker["port"], picker["failureMode"]) == (PICKER, {"number": 9002}, "FailOpen")
    assert (picker["group"], picker["kind"]) == ("", "Service")  # defaulted by the API server: a stored object
    assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    (listed,) = env.kubectl.json("get", "infpool", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}")[
        "items"
    ]
    assert listed["metadata"]["uid"] == stored["metadata"]["uid"]


def _failure_mode(spec: dict[str, Any]) -> None:
    spec["endpointPickerRef"]["failureMode"] = "FailSometimes"


def _no_target_ports(spec: dict[str, Any]) -> None:
    del spec["targetPorts"]


def _no_picker_port(spec: dict[str, Any]) -> None:
    del spec["endpointPickerRef"]["port"]


@pytest.mark.parametrize(
    ("name", "spoil", "message"),
    [
        ("bad-failure-mode", _failure_mode, 'spec.endpointPickerRef.failureMode: Unsupported value: "FailSometimes"'),
        ("no-target-ports", _no_target_ports, "spec.targetPorts: Required value"),
        ("no-picker-port", _no_picker_port, "port is required when kind is 'Service'"),  # a CEL rule
    ],
    ids=["bad-failure-mode", "no-target-ports", "no-picker-port"],
)
def test_api_server_refuses_an_invalid_pool(
    env: Env, name: str, spoil: Callable[[dict[str, Any]], None], message: str
) -> None:
    pool = copy.deepcopy(env.pool)
    pool["metadata"]["name"] = name
    spoil(pool["spec"])
    with pytest.raises(KubectlError) as refused:
        env.create(pool)
    assert message in refused.value.stderr, refused.value.stderr
    with pytest.raises(KubectlError, match="NotFound"):
        env.get(name)
