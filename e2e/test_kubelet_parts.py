"""The process kubelet's parts, without a cluster where possible: env expansion, probes, scheduling fit, a pod's
processes, volumes and mount paths, the local-path provisioner, termination messages."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.api import ApiError
from e2e.container import MAX_LOG_BYTES, MAX_LOG_LINES
from e2e.container_env import ConfigError, build_env, expand, field_value
from e2e.kubectl import Kubectl, wait_until
from e2e.node import NodeConfig, unfit_reason
from e2e.pod_runtime import PodRuntime, image_repository
from e2e.probe import ProbeState
from e2e.volumes import (
    PROVISIONER,
    MountTable,
    VolumeError,
    claims_unfit_reason,
    local_path_volume,
    reclaim_released,
    volume_dirs,
)

POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "a"}},
    "spec": {"containers": []},
    "status": {"podIP": "127.9.9.2", "podIPs": [{"ip": "127.9.9.2"}]},
}


class FakeApi:
    """Objects by API path; writes are recorded (and creates stored) so a test can look at them."""

    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects
        self.created: list[tuple[str, Any]] = []
        self.deleted: list[str] = []

    def get(self, path: str, **params: Any) -> Any:
        if path not in self.objects:
            raise ApiError("GET", path, 404, "not found")
        return self.objects[path]

    def create(self, path: str, body: Any) -> Any:
        self.created.append((path, body))
        self.objects[f"{path}/{body['metadata']['name']}"] = body
        return body

    def delete(self, path: str, body: Any = None) -> Any:
        self.deleted.append(path)
        return self.objects.pop(path)


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


# volumes and mount paths


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/cache", "/host/c"),
        ("/cache/models/x", "/host/c/models/x"),
        ("--model-cache=/cache", "--model-cache=/host/c"),
        ("--dirs=/cache:/data/sub", "--dirs=/host/c:/host/d/sub"),
        ("/cache2/x", "/cache2/x"),  # another path that only starts with the same letters
        ("/opt/cache", "/opt/cache"),  # inside a path
        ("/data/deep/x", "/host/deep/x"),  # the longest mount path wins
        ("s3://models/cache", "s3://models/cache"),
    ],
)
def test_mount_paths_translate_where_a_path_starts(text: str, expected: str) -> None:
    table = MountTable({"/cache/": Path("/host/c"), "/data": Path("/host/d"), "/data/deep": Path("/host/deep")})
    assert table.translate(text) == expected


def _claim(name: str, phase: str = "Pending", volume: str = "", storage_class: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Gi"}}}
    if volume:
        spec["volumeName"] = volume
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def _claim_path(name: str) -> str:
    return f"/api/v1/namespaces/ns/persistentvolumeclaims/{name}"


def _pod_with_volumes(*volumes: dict[str, Any]) -> dict[str, Any]:
    return {**POD, "spec": {"containers": [], "volumes": list(volumes)}}


def test_volume_dirs_for_each_kind(tmp_path: Path) -> None:
    shared = tmp_path / "claims" / "shared"
    api = FakeApi(
        {
            _claim_path("cache"): _claim("cache", "Bound", "pv-1"),
            "/api/v1/persistentvolumes/pv-1": {"spec": {"hostPath": {"path": str(shared)}}},
        }
    )
    pod = _pod_with_volumes(
        {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "host", "hostPath": {"path": str(tmp_path / "host"), "type": "DirectoryOrCreate"}},
        {"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}},
        {"name": "token", "projected": {"sources": []}},
    )
    dirs = volume_dirs(api, pod, tmp_path / "pod")  # type: ignore[arg-type]
    assert dirs == {"scratch": tmp_path / "pod/volumes/scratch", "host": tmp_path / "host", "cache": shared}
    assert all(path.is_dir() for path in dirs.values())


@pytest.mark.parametrize(
    ("objects", "message"),
    [
        ({}, 'persistentvolumeclaim "cache" not found'),
        ({_claim_path("cache"): _claim("cache")}, 'persistentvolumeclaim "cache" is not bound yet (phase Pending)'),
        (
            {
                _claim_path("cache"): _claim("cache", "Bound", "nfs-1"),
                "/api/v1/persistentvolumes/nfs-1": {"spec": {"nfs": {"server": "x", "path": "/"}}},
            },
            'persistentvolume "nfs-1" of claim "cache" is not a hostPath volume',
        ),
    ],
)
def test_a_claim_that_cannot_be_mounted_says_why(tmp_path: Path, objects: dict[str, Any], message: str) -> None:
    pod = _pod_with_volumes({"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}})
    with pytest.raises(VolumeError, match=re.escape(message)):
        volume_dirs(FakeApi(objects), pod, tmp_path)  # type: ignore[arg-type]


def test_the_node_provisions_a_local_path_volume_for_a_pending_claim(tmp_path: Path) -> None:
    api = FakeApi({_claim_path("cache"): _claim("cache"), _claim_path("other"): _claim("other", storage_class="ssd")})
    claim_volume = {"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}}
    assert claims_unfit_reason(api, _pod_with_volumes(claim_volume), "node-0", tmp_path) is None  # type: ignore[arg-type]
    [(path, volume)] = api.created
    assert path == "/api/v1/persistentvolumes"
    assert volume == local_path_volume(_claim("cache"), "node-0", tmp_path)
    ref = volume["spec"]["claimRef"]
    assert (ref["namespace"], ref["name"], ref["uid"]) == ("ns", "cache", "uid-cache")
    assert volume["spec"]["capacity"] == {"storage": "2Gi"} and volume["spec"]["accessModes"] == ["ReadWriteMany"]
    assert volume["spec"]["storageClassName"] == "" and volume["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    host = Path(volume["spec"]["hostPath"]["path"])
    assert host == tmp_path / "volumes" / "ns_cache_uid-cache" and host.is_dir()
    assert volume["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] == PROVISIONER

    missing = _pod_with_volumes({"name": "m", "persistentVolumeClaim": {"claimName": "missing"}})
    assert 'persistentvolumeclaim "missing" not found' in str(claims_unfit_reason(api, missing, "node-0", tmp_path))  # type: ignore[arg-type]
    other = _pod_with_volumes({"name": "o", "persistentVolumeClaim": {"claimName": "other"}})
    assert "unbound PersistentVolumeClaim \"other\" (class 'ssd')" in str(
        claims_unfit_reason(api, other, "node-0", tmp_path)  # type: ignore[arg-type]
    )
    assert len(api.created) == 1  # a class the node does not provision gets nothing


def test_released_local_path_volumes_are_deleted_with_their_directory(tmp_path: Path) -> None:
    released = local_path_volume(_claim("gone"), "node-0", tmp_path)
    released["status"] = {"phase": "Released"}
    bound = local_path_volume(_claim("kept"), "node-0", tmp_path)
    bound["status"] = {"phase": "Bound"}
    for volume in (released, bound):
        Path(volume["spec"]["hostPath"]["path"]).mkdir(parents=True)
    api = FakeApi({"/api/v1/persistentvolumes": {"items": [released, bound]}})
    api.objects.update({f"/api/v1/persistentvolumes/{v['metadata']['name']}": v for v in (released, bound)})
    assert reclaim_released(api, "node-0", tmp_path) == ["pvc-uid-gone"]  # type: ignore[arg-type]
    assert not Path(released["spec"]["hostPath"]["path"]).exists()
    assert Path(bound["spec"]["hostPath"]["path"]).is_dir()


def _env_builder(pod: dict[str, Any], spec: dict[str, Any]) -> dict[str, str]:
    env = {**os.environ, "POD_IP": pod["status"]["podIP"]}
    env.update({var["name"]: expand(var["value"], env) for var in spec.get("env", [])})
    return env


def _run_until_exit(runtime: PodRuntime, pod: dict[str, Any], resolve: Any, num_exits: int = 1) -> dict[str, Any]:
    """Syncs the pod until its first container has exited `num_exits` times; its containerStatus."""

    def exited() -> dict[str, Any] | None:
        runtime.sync(pod, _env_builder, resolve)
        status = runtime.status()["containerStatuses"][0]
        container = runtime.containers[0]
        is_down = container.process is None and container.terminated is not None
        return status if is_down and container.restart_count + 1 >= num_exits else None

    return wait_until(exited, 30, "container exit", interval=0.1)


def test_pods_sharing_a_claim_see_one_directory_through_their_mount_paths(tmp_path: Path) -> None:
    shared = tmp_path / "claim"
    resolve = lambda pod: {"cache": shared, "scratch": tmp_path / pod["metadata"]["name"] / "scratch"}  # noqa: E731
    script = "import os, sys; open(sys.argv[1] + '/' + os.environ['NAME'], 'w').write(os.environ['SCRATCH'])"
    for name in ("a", "b"):
        container = {
            "name": "c",
            "command": [sys.executable, "-c", script],
            "args": ["/var/cache/models"],
            "env": [{"name": "NAME", "value": name}, {"name": "SCRATCH", "value": "/scratch/tmp"}],
            "volumeMounts": [
                {"name": "cache", "mountPath": "/var/cache/models"},
                {"name": "scratch", "mountPath": "/scratch"},
            ],
        }
        pod = {**POD, "metadata": {**POD["metadata"], "name": name, "uid": f"u-{name}"}}
        pod["spec"] = {"restartPolicy": "Never", "containers": [container]}
        runtime = PodRuntime(pod, "127.9.9.5", tmp_path / f"pod-{name}", {})
        status = _run_until_exit(runtime, pod, resolve)
        assert status["state"]["terminated"]["exitCode"] == 0, (tmp_path / f"pod-{name}" / "c.log").read_text()
    assert (shared / "a").read_text() == str(tmp_path / "a" / "scratch" / "tmp")
    assert sorted(p.name for p in shared.iterdir()) == ["a", "b"]


def test_containers_wait_while_a_volume_is_not_ready(tmp_path: Path) -> None:
    container = {"name": "c", "command": [sys.executable, "-c", "pass"]}
    pod = {**POD, "spec": {"restartPolicy": "Never", "containers": [container], "volumes": []}}
    runtime = PodRuntime(pod, "127.9.9.6", tmp_path, {})

    def pending(pod: dict[str, Any]) -> dict[str, Path]:
        raise VolumeError('persistentvolumeclaim "cache" not found')

    runtime.sync(pod, _env_builder, pending)
    assert runtime.phase() == "Pending" and runtime.containers[0].process is None
    waiting = runtime.status()["containerStatuses"][0]["state"]["waiting"]
    assert waiting == {
        "reason": "ContainerCreating",
        "message": 'waiting for volumes: persistentvolumeclaim "cache" not found',
    }
    status = _run_until_exit(runtime, pod, lambda pod: {})
    assert status["state"]["terminated"]["exitCode"] == 0


def test_fallback_to_logs_on_error_puts_this_runs_log_tail_in_the_status(tmp_path: Path) -> None:
    script = (
        "import os, sys; run = os.environ['RUN']; [print(f'{run} line {i}', flush=True) for i in range(200)]; "
        "print('loraplane: failed to start: s3://models/nope: no objects under this prefix', file=sys.stderr); "
        "sys.exit(1)"
    )
    container = {
        "name": "server",
        "command": [sys.executable, "-c", script],
        "env": [{"name": "RUN", "value": "first"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod = {**POD, "spec": {"restartPolicy": "Always", "containers": [container]}}
    runtime = PodRuntime(pod, "127.9.9.7", tmp_path, {})
    status = _run_until_exit(runtime, pod, None)
    message = status["lastState"]["terminated"]["message"]
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert message.endswith("loraplane: failed to start: s3://models/nope: no objects under this prefix\n")
    assert len(message.encode()) <= MAX_LOG_BYTES and message.count("\n") <= MAX_LOG_LINES
    assert "first line 199" in message and "first line 0\n" not in message

    container["env"] = [{"name": "RUN", "value": "second"}]  # the restart's own log, not the first run's
    runtime.containers[0].restart_at = 0.0
    second = _run_until_exit(runtime, pod, None, num_exits=2)["lastState"]["terminated"]["message"]
    assert "second line 199" in second and "first line" not in second


def test_termination_message_file_is_read_at_its_translated_path(tmp_path: Path) -> None:
    write = "import sys; open(sys.argv[1], 'w').write('model corrupt'); print('noise'); sys.exit(3)"
    python = sys.executable
    quiet: dict[str, Any] = {"name": "quiet", "command": [python, "-c", "import sys; print('noise'); sys.exit(2)"]}
    container: dict[str, Any] = {"name": "c", "command": [python, "-c", write], "args": ["/dev/termination-log"]}
    custom: dict[str, Any] = {"name": "d", "command": [python, "-c", write], "args": ["/run/why"]}
    custom["terminationMessagePath"] = "/run/why"
    for spec, expected in ((container, "model corrupt"), (custom, "model corrupt"), (quiet, None)):
        pod = {**POD, "spec": {"restartPolicy": "Never", "containers": [spec]}}
        status = _run_until_exit(PodRuntime(pod, "127.9.9.8", tmp_path / spec["name"], {}), pod, None)
        assert status["state"]["terminated"].get("message") == expected
        assert status["lastState"] == {}
    assert not Path("/run/why").exists()


# a claim on the real control plane


@pytest.mark.e2e
def test_a_claim_binds_through_the_pv_controller_and_pods_share_it(kubectl: Kubectl, namespace: str) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }

    def pod(name: str, script: str) -> dict[str, Any]:
        container = {
            "name": "c",
            "image": "python:3-slim",
            "command": [sys.executable, "-c", script, "/shared"],
            "volumeMounts": [{"name": "data", "mountPath": "/shared"}],
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
        volume = {"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}
        spec = {"restartPolicy": "Never", "containers": [container], "volumes": [volume]}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    def get(kind: str, name: str) -> dict[str, Any]:
        return dict(kubectl.json("get", kind, name, "-n", namespace))

    kubectl.apply(pod("writer", "import sys; open(sys.argv[1] + '/note', 'w').write('hello')"), namespace)

    def unschedulable() -> str | None:
        conditions = get("pod", "writer").get("status", {}).get("conditions", [])
        return next((c["message"] for c in conditions if c.get("reason") == "Unschedulable"), None)

    message = wait_until(unschedulable, 30, "writer Unschedulable")
    assert 'persistentvolumeclaim "shared" not found' in message
    assert get("pod", "writer")["status"]["phase"] == "Pending"

    kubectl.apply(claim, namespace)
    wait_until(lambda: get("pvc", "shared").get("status", {}).get("phase") == "Bound", 60, "claim Bound")
    volume = get("pv", get("pvc", "shared")["spec"]["volumeName"])
    assert volume["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"] == PROVISIONER
    assert volume["status"]["phase"] == "Bound"

    def terminated(name: str) -> dict[str, Any] | None:
        statuses = get("pod", name).get("status", {}).get("containerStatuses") or [{}]
        return statuses[0].get("state", {}).get("terminated")

    assert wait_until(lambda: terminated("writer"), 60, "writer done")["exitCode"] == 0
    reader = "import sys; print(open(sys.argv[1] + '/note').read()); sys.exit(4)"
    kubectl.apply(pod("reader", reader), namespace)
    state = wait_until(lambda: terminated("reader"), 60, "reader done")
    assert (state["exitCode"], state["message"]) == (4, "hello\n")  # FallbackToLogsOnError: the log's tail

    kubectl("delete", "pod", "writer", "reader", "-n", namespace, "--wait=true", timeout=90)
    kubectl("delete", "pvc", "shared", "-n", namespace, "--wait=true", timeout=90)
    host = Path(volume["spec"]["hostPath"]["path"])
    wait_until(lambda: not host.exists(), 60, "the released volume's directory removed")
    with pytest.raises(Exception, match="NotFound|not found"):
        get("pv", volume["metadata"]["name"])
