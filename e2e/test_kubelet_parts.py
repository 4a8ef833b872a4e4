"""The process kubelet's parts without a cluster: env expansion, probes, scheduling fit, a pod's processes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.container_env import ConfigError, build_env, expand, field_value
from e2e.kubectl import wait_until
from e2e.node import NodeConfig, unfit_reason
from e2e.pod_runtime import PodRuntime, image_repository
from e2e.probe import ProbeState

POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "a"}},
    "spec": {"containers": []},
    "status": {"podIP": "127.9.9.2", "podIPs": [{"ip": "127.9.9.2"}]},
}


class FakeApi:
    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects

    def get(self, path: str) -> Any:
        from e2e.api import ApiError

        if path not in self.objects:
            raise ApiError("GET", path, 404, "not found")
        return self.objects[path]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--host=$(POD_IP)", "--host=127.9.9.2"),
        ("$$(POD_IP)", "$(POD_IP)"),
        ("$(UNDEFINED)", "$(UNDEFINED)"),
        ("a$b$", "a$b$"),
        ("$(A)-$(A)", "x-x"),
        ("$(unclosed", "$(unclosed"),
    ],
)
def test_expand_follows_kubernetes(text: str, expected: str) -> None:
    assert expand(text, {"POD_IP": "127.9.9.2", "A": "x"}) == expected


def test_field_values() -> None:
    assert field_value(POD, "status.podIP") == "127.9.9.2"
    assert field_value(POD, "metadata.namespace") == "ns"
    assert field_value(POD, "metadata.labels['app']") == "a"
    assert field_value(POD, "status.podIPs") == "127.9.9.2"


def test_build_env_resolves_refs_in_order() -> None:
    api = FakeApi(
        {
            "/api/v1/namespaces/ns/secrets/s": {"data": {"token": "c2VjcmV0"}},
            "/api/v1/namespaces/ns/configmaps/c": {"data": {"MODE": "fast"}},
        }
    )
    container = {
        "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "CM_"}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(IP):8000/$(CM_MODE)"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k", "optional": True}}},
        ],
    }
    env = build_env(api, POD, container, {"BASE": "1"})  # type: ignore[arg-type]
    assert env["URL"] == "http://127.9.9.2:8000/fast"
    assert env["TOKEN"] == "secret" and env["BASE"] == "1" and "OPT" not in env
    missing = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k"}}}]}
    with pytest.raises(ConfigError):
        build_env(api, POD, missing, {})  # type: ignore[arg-type]


def test_probe_thresholds() -> None:
    state = ProbeState({"failureThreshold": 2, "successThreshold": 1}, is_passing=False)
    state.record(True)
    assert state.is_passing
    state.record(False)
    assert state.is_passing
    state.record(False)
    assert not state.is_passing and state.has_failed


def test_gpu_fit() -> None:
    config = NodeConfig(num_gpus=8)

    def pod(gpus: int, selector: dict[str, str] | None = None) -> dict[str, Any]:
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}}
        return {"spec": {"nodeSelector": selector or {}, "containers": [{"name": "c", "resources": resources}]}}

    assert unfit_reason(config, pod(4), [pod(4)]) is None
    assert "Insufficient nvidia.com/gpu" in str(unfit_reason(config, pod(1), [pod(4), pod(4)]))
    assert "selector" in str(unfit_reason(config, pod(0, {"gpu": "h100"}), []))
    assert unfit_reason(config, pod(0, {"nvidia.com/gpu.present": "true"}), []) is None


def test_image_repository() -> None:
    assert image_repository("ghcr.io/org/loraplane:0.1@sha256:ab") == "ghcr.io/org/loraplane"
    assert image_repository("localhost:5000/server:dev") == "localhost:5000/server"
    assert image_repository("python") == "python"


def _free_loopback_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


def test_pod_runtime_runs_probes_restarts_and_stops(tmp_path: Path) -> None:
    ip = "127.9.9.3"
    port = _free_loopback_port(ip)
    container = {
        "name": "http",
        "command": [sys.executable, "-m", "http.server"],
        "args": ["--bind", "$(POD_IP)", str(port)],
        "readinessProbe": {"httpGet": {"path": "/", "port": port}, "periodSeconds": 1},
    }
    pod = {**POD, "spec": {"containers": [container]}}
    runtime = PodRuntime(pod, ip, tmp_path / "pod", {})
    build = lambda pod, spec: {**os.environ, "POD_IP": pod["status"]["podIP"]}  # noqa: E731
    try:
        runtime.sync(pod, build)
        assert runtime.phase() == "Running"
        wait_until(lambda: runtime.status()["conditions"][3]["status"] == "True", 20, "Ready")
        process = runtime.containers[0].process
        assert process is not None
        os.killpg(process.pid, signal.SIGKILL)

        def restarted() -> bool:
            runtime.sync(pod, build)
            return runtime.containers[0].restart_count == 1 and runtime.containers[0].is_ready

        wait_until(restarted, 30, "restart", interval=0.2)
        status = runtime.status()["containerStatuses"][0]
        assert status["lastState"]["terminated"]["exitCode"] == 137
    finally:
        started = time.monotonic()
        runtime.stop(5.0)
    assert time.monotonic() - started < 5.0  # http.server exits on SIGTERM
    assert runtime.containers[0].process is not None and runtime.containers[0].process.poll() is not None


def test_container_without_command_uses_the_image_entrypoint(tmp_path: Path) -> None:
    container = {"name": "server", "image": "ghcr.io/org/loraplane:0.1", "args": ["serve", "--port", "8000"]}
    pod = {**POD, "spec": {"containers": [container]}}
    runtime = PodRuntime(pod, "127.9.9.4", tmp_path, {"ghcr.io/org/loraplane": ["loraplane"]})
    assert runtime._argv(container) == ["loraplane", "serve", "--port", "8000"]
    assert PodRuntime(pod, "127.9.9.4", tmp_path, {})._argv(container) == []  # CreateContainerError
