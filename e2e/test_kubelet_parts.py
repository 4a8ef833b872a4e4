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
from e2e.cluster import LocalCluster
from e2e.container import MAX_LOG_BYTES, MAX_LOG_LINES
from e2e.container_env import ConfigError, build_env, expand, field_value
from e2e.kubectl import Kubectl, wait_until
from e2e.node import NodeConfig, unfit_reason
from e2e.pod_runtime import SIDECAR_UNSUPPORTED, PodRuntime, image_repository
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


# init containers


def _pod_with_init(init: list[dict[str, Any]], main: dict[str, Any], restart_policy: str) -> dict[str, Any]:
    spec = {"restartPolicy": restart_policy, "initContainers": init, "containers": [main]}
    return {**POD, "spec": {**spec, "volumes": [{"name": "cache", "emptyDir": {}}]}}


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def _sync_until(runtime: PodRuntime, pod: dict[str, Any], check: Any, what: str, resolve: Any = None) -> Any:
    """Syncs the pod until `check()` returns something truthy (returned)."""

    def synced() -> Any:
        runtime.sync(pod, _env_builder, resolve)
        return check()

    return wait_until(synced, 30, what, interval=0.1)


def test_init_container_fills_an_empty_dir_before_the_container_starts(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fetch = (
        "import sys, time; time.sleep(0.5); open('runs', 'a').write('run\\n'); open(sys.argv[1], 'w').write('weights')"
    )
    init = {
        "name": "pull",
        "command": [sys.executable, "-c", fetch],
        "args": ["$(TARGET)"],
        "env": [{"name": "TARGET", "value": "/models/m"}],
        "workingDir": "/models",
        "volumeMounts": [{"name": "cache", "mountPath": "/models"}],
    }
    serve = "import sys; print('serving ' + open(sys.argv[1]).read())"  # exits 1 had it run before the file existed
    main = {
        "name": "server",
        "command": [sys.executable, "-c", serve, "/srv/m"],
        "volumeMounts": [{"name": "cache", "mountPath": "/srv"}],
    }
    pod = _pod_with_init([init], main, "Always")
    runtime = PodRuntime(pod, "127.9.9.9", tmp_path / "pod", {})
    resolve = lambda pod: {"cache": cache}  # noqa: E731
    try:
        runtime.sync(pod, _env_builder, resolve)
        status = runtime.status()
        initialized = _condition(status, "Initialized")
        assert (status["phase"], initialized["status"], initialized["reason"]) == (
            "Pending",
            "False",
            "ContainersNotInitialized",
        )
        assert initialized["message"] == "containers with incomplete status: [pull]"
        [pulling] = status["initContainerStatuses"]
        assert "running" in pulling["state"] and not pulling["ready"]
        assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
        assert runtime.containers[0].process is None

        server = runtime.containers[0]  # Always: restarted after it exits, but the init container is not rerun
        _sync_until(runtime, pod, lambda: server.restart_count >= 1 and server.process is None, "restart", resolve)
        status = runtime.status()
        [pulled] = status["initContainerStatuses"]
        assert pulled["state"]["terminated"]["exitCode"] == 0 and pulled["state"]["terminated"]["reason"] == "Completed"
        assert pulled["ready"] and pulled["restartCount"] == 0
        initialized = _condition(status, "Initialized")
        assert initialized["status"] == "True" and "reason" not in initialized
        assert status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 0
        assert (cache / "runs").read_text() == "run\n"
        assert (tmp_path / "pod" / "pull.log").exists()
        served = (tmp_path / "pod" / "server.log").read_text().splitlines()
        assert len(served) >= 2 and set(served) == {"serving weights"}
    finally:
        runtime.stop(5.0)


def test_a_failing_init_container_is_retried_and_holds_the_containers_back(tmp_path: Path) -> None:
    marker = tmp_path / "model-ready"
    fetch = (
        "import os, sys; ok = os.path.exists(sys.argv[1]); print('ok' if ok else 'no model yet'); sys.exit(3 - 3 * ok)"
    )
    init = {
        "name": "pull",
        "command": [sys.executable, "-c", fetch, str(marker)],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    main = {"name": "server", "command": [sys.executable, "-c", "import time; time.sleep(60)"]}
    pod = _pod_with_init([init], main, "Always")
    runtime = PodRuntime(pod, "127.9.9.10", tmp_path / "pod", {})

    def backing_off() -> dict[str, Any] | None:
        status = runtime.status()["initContainerStatuses"][0]
        return status if status["restartCount"] >= 1 and "waiting" in status["state"] else None

    try:
        pulling = _sync_until(runtime, pod, backing_off, "a retried init container in back-off")
        assert pulling["state"]["waiting"]["reason"] == "CrashLoopBackOff" and not pulling["ready"]
        terminated = pulling["lastState"]["terminated"]
        assert (terminated["exitCode"], terminated["reason"], terminated["message"]) == (3, "Error", "no model yet\n")
        status = runtime.status()
        assert status["phase"] == "Pending" and _condition(status, "Initialized")["status"] == "False"
        assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
        assert runtime.containers[0].started_at is None

        marker.touch()
        _sync_until(runtime, pod, lambda: runtime.phase() == "Running", "the server running once init succeeded")
        pulled = runtime.status()["initContainerStatuses"][0]
        assert pulled["state"]["terminated"]["reason"] == "Completed" and pulled["ready"]
        assert pulled["restartCount"] >= 1 and "message" not in pulled["state"]["terminated"]
        assert _condition(runtime.status(), "Initialized")["status"] == "True"
    finally:
        runtime.stop(5.0)


def test_a_failed_init_container_fails_a_never_pod_and_nothing_after_it_runs(tmp_path: Path) -> None:
    write = "import sys; open(sys.argv[1], 'w').write('bad model uri'); sys.exit(2)"
    first = {"name": "pull", "command": [sys.executable, "-c", write, "/dev/termination-log"]}
    second = {"name": "link", "command": [sys.executable, "-c", "open('link-ran', 'w')"]}
    main = {"name": "server", "command": [sys.executable, "-c", "open('server-ran', 'w')"]}
    pod = _pod_with_init([first, second], main, "Never")
    runtime = PodRuntime(pod, "127.9.9.11", tmp_path, {})
    _sync_until(runtime, pod, lambda: runtime.phase() == "Failed", "the pod Failed")
    time.sleep(1.5)  # a retry would have come after a 1 s back-off
    runtime.sync(pod, _env_builder, None)
    status = runtime.status()
    assert status["phase"] == "Failed"
    pull, link = status["initContainerStatuses"]
    terminated = pull["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"], terminated["message"]) == (2, "Error", "bad model uri")
    assert pull["restartCount"] == 0 and not pull["ready"]
    assert link["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert _condition(status, "Initialized")["message"] == "containers with incomplete status: [pull link]"
    assert not (tmp_path / "link-ran").exists() and not (tmp_path / "server-ran").exists()


def test_stopping_a_pod_during_init_stops_the_init_container(tmp_path: Path) -> None:
    init = {"name": "pull", "command": [sys.executable, "-c", "import time; time.sleep(60)"]}
    main = {"name": "server", "command": [sys.executable, "-c", "open('server-ran', 'w')"]}
    pod = _pod_with_init([init], main, "Always")
    runtime = PodRuntime(pod, "127.9.9.12", tmp_path, {})
    runtime.sync(pod, _env_builder, None)
    process = runtime.init_containers[0].process
    assert process is not None and process.poll() is None
    started = time.monotonic()
    runtime.stop(5.0)
    assert time.monotonic() - started < 5.0 and process.poll() is not None
    runtime.sync(pod, _env_builder, None)  # a sync that races the deletion starts nothing
    assert runtime.containers[0].process is None and not (tmp_path / "server-ran").exists()


def test_a_sidecar_init_container_is_refused_rather_than_waited_for(tmp_path: Path) -> None:
    sidecar = {"name": "proxy", "restartPolicy": "Always", "command": [sys.executable, "-c", "open('ran', 'w')"]}
    main = {"name": "server", "command": [sys.executable, "-c", "open('server-ran', 'w')"]}
    pod = _pod_with_init([sidecar], main, "Always")
    runtime = PodRuntime(pod, "127.9.9.13", tmp_path, {})
    runtime.sync(pod, _env_builder, None)
    status = runtime.status()
    waiting = status["initContainerStatuses"][0]["state"]["waiting"]
    assert waiting == {"reason": "CreateContainerError", "message": SIDECAR_UNSUPPORTED}
    assert status["phase"] == "Pending" and runtime.init_containers[0].process is None
    assert not (tmp_path / "ran").exists() and not (tmp_path / "server-ran").exists()


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


# init containers on the real control plane


@pytest.mark.e2e
def test_init_containers_on_the_kubelet_as_kubectl_shows_them(
    kubectl: Kubectl, cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    marker, pid_file = tmp_path / "model-ready", tmp_path / "init.pid"
    fetch = (
        "import os, sys; ok = os.path.exists(sys.argv[1]); print('ok' if ok else 'no model yet'); "
        "ok and open(sys.argv[2], 'w').write('weights'); sys.exit(0 if ok else 3)"
    )
    serve = "import sys, time; print('serving ' + open(sys.argv[1]).read(), flush=True); time.sleep(600)"
    never_ran = tmp_path / "never-server-ran"
    wait_forever = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    pods = {
        "always": (
            "Always",
            [sys.executable, "-c", fetch, str(marker), "/cache/m"],
            [sys.executable, "-c", serve, "/cache/m"],
        ),
        "never": ("Never", [sys.executable, "-c", "import sys; sys.exit(1)"], ["touch", str(never_ran)]),
        "slow": ("Always", [sys.executable, "-c", wait_forever, str(pid_file)], ["touch", str(never_ran)]),
    }
    for name, (policy, init_command, command) in pods.items():
        mounts = [{"name": "cache", "mountPath": "/cache"}]
        init = {"name": "pull", "image": "loraplane", "command": init_command, "volumeMounts": mounts}
        init["terminationMessagePolicy"] = "FallbackToLogsOnError"
        main = {"name": "server", "image": "loraplane", "command": command, "volumeMounts": mounts}
        spec = {"restartPolicy": policy, "terminationGracePeriodSeconds": 5, "initContainers": [init]}
        spec.update(containers=[main], volumes=[{"name": "cache", "emptyDir": {}}])
        kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, namespace)

    def printed(name: str) -> str:
        """The STATUS column of `kubectl get pod` (the API server's table, derived from initContainerStatuses)."""
        return kubectl("get", "pod", name, "-n", namespace, "--no-headers").split()[2]

    def pod(name: str) -> dict[str, Any]:
        return dict(kubectl.json("get", "pod", name, "-n", namespace))

    wait_until(lambda: printed("never") == "Init:Error", 30, "never: Init:Error")
    status = pod("never")["status"]
    assert status["phase"] == "Failed" and status["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}

    wait_until(lambda: printed("always") == "Init:CrashLoopBackOff", 30, "always: Init:CrashLoopBackOff")
    status = pod("always")["status"]
    initialized = _condition(status, "Initialized")
    assert (status["phase"], initialized["status"], initialized["reason"]) == (
        "Pending",
        "False",
        "ContainersNotInitialized",
    )
    assert status["initContainerStatuses"][0]["lastState"]["terminated"]["message"] == "no model yet\n"
    marker.touch()
    wait_until(lambda: printed("always") == "Running", 30, "always: Running once init succeeded")
    wait_until(lambda: cluster.pod_log(namespace, "always", "server") == "serving weights\n", 10, "the server's log")
    assert pod("always")["status"]["initContainerStatuses"][0]["restartCount"] >= 1

    assert wait_until(lambda: printed("slow") == "Init:0/1" and pid_file.exists(), 30, "slow: Init:0/1")
    pid = int(pid_file.read_text())
    kubectl("delete", "pod", "slow", "-n", namespace, "--wait=true", timeout=60)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not never_ran.exists()
