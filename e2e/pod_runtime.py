"""One pod on the process kubelet: its loopback IP, directory, containers and status."""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.api import ApiError
from e2e.container import Container, now_iso
from e2e.container_env import ConfigError, expand
from e2e.process import signal_group
from e2e.volumes import MountTable, VolumeError

# Builds a container's environment; raises ConfigError when a referenced object is missing.
EnvBuilder = Callable[[dict[str, Any], dict[str, Any]], dict[str, str]]
# Volume name -> host directory for a pod; raises VolumeError while a volume cannot be set up.
VolumeResolver = Callable[[dict[str, Any]], dict[str, Path]]


def image_repository(image: str) -> str:
    """`registry/org/name:tag@digest` -> `registry/org/name`."""
    image = image.split("@", 1)[0]
    head, _, tail = image.rpartition("/")
    return f"{head}/{tail.split(':', 1)[0]}" if head else tail.split(":", 1)[0]


class PodRuntime:
    """Created when a pod lands on the node; the kubelet's sync loop calls `sync` and `status`."""

    def __init__(self, pod: dict[str, Any], pod_ip: str, directory: Path, entrypoints: dict[str, list[str]]) -> None:
        self.uid: str = pod["metadata"]["uid"]
        self.pod = pod
        self.pod_ip = pod_ip
        self.dir = directory
        self.entrypoints = entrypoints
        self.start_time = now_iso()
        self.restart_policy: str = pod["spec"].get("restartPolicy", "Always")
        self.containers = [Container(c, directory / f"{c['name']}.log") for c in pod["spec"]["containers"]]
        self.is_terminating = False
        self.is_stopped = False
        self._transitions: dict[str, tuple[str, str]] = {}  # condition type -> (status, lastTransitionTime)
        self.mounts: dict[str, MountTable] | None = None  # container name -> its mounts, once volumes are set up
        directory.mkdir(parents=True, exist_ok=True)

    def sync(self, pod: dict[str, Any], build: EnvBuilder, resolve_volumes: VolumeResolver | None = None) -> None:
        """Sets up the volumes once, reaps exited processes and (re)starts the containers that are due."""
        self.pod = pod
        if self.mounts is None and not self._set_up_volumes(resolve_volumes):
            return
        now = time.monotonic()
        for container in self.containers:
            container.reap(self.restart_policy)
            if not self.is_terminating and container.is_due(now):
                self._start(container, build)

    def _set_up_volumes(self, resolve: VolumeResolver | None) -> bool:
        """True once every volume has a host directory; until then the containers wait, saying why."""
        try:
            dirs = resolve(self.pod) if resolve is not None else {}
        except VolumeError as error:
            for container in self.containers:
                container.waiting = {"reason": "ContainerCreating", "message": f"waiting for volumes: {error}"}
            return False
        self.mounts = {c.name: MountTable.for_container(c.spec, dirs, c.termination_file) for c in self.containers}
        return True

    def _start(self, container: Container, build: EnvBuilder) -> None:
        ips = [{"ip": self.pod_ip}]
        status = {**self.pod.get("status", {}), "podIP": self.pod_ip, "podIPs": ips, "hostIP": "127.0.0.1"}
        assert self.mounts is not None
        spec = self.mounts[container.name].translate_spec(container.spec)
        try:
            env = build({**self.pod, "status": status}, spec)
        except (ConfigError, ApiError) as error:
            container.fail_to_start("CreateContainerConfigError", str(error))
            return
        argv = self._argv(spec)
        if not argv:
            image = spec.get("image", "")
            container.fail_to_start("CreateContainerError", f"no command, and no entrypoint known for image {image}")
            return
        argv = [expand(arg, env) for arg in argv]
        cwd = Path(spec["workingDir"]) if spec.get("workingDir") else self.dir
        try:
            container.start(argv, env, cwd, self.pod_ip)
        except OSError as error:
            container.fail_to_start("StartError", f"{argv[0]}: {error}")

    def _argv(self, spec: dict[str, Any]) -> list[str]:
        """command + args; without a command, the image's entrypoint if the kubelet was told it, else []."""
        command = spec.get("command") or self.entrypoints.get(image_repository(spec.get("image", "")), [])
        return [*command, *spec.get("args", [])] if command else []

    def stop(self, grace_seconds: float) -> None:
        """SIGTERM every container at once, then stop each within what is left of the grace period."""
        self.is_terminating = True
        deadline = time.monotonic() + grace_seconds
        for container in self.containers:
            if container.process is not None:
                signal_group(container.process, signal.SIGTERM)
        for container in self.containers:
            container.stop(max(0.0, deadline - time.monotonic()))
        self.is_stopped = True

    # status

    def phase(self) -> str:
        statuses = [c.status()["state"] for c in self.containers]
        if any("running" in s for s in statuses):
            return "Running"
        if all("terminated" in s for s in statuses):
            failed = any(s["terminated"]["exitCode"] != 0 for s in statuses)
            return "Failed" if failed else "Succeeded"
        has_started = any(c.started_at for c in self.containers)
        return "Running" if has_started else "Pending"

    def status(self) -> dict[str, Any]:
        ready = all(c.is_ready for c in self.containers)
        conditions = {
            "PodReadyToStartContainers": True,
            "Initialized": True,
            "ContainersReady": ready,
            "Ready": ready,
            "PodScheduled": True,
        }
        ips = [{"ip": self.pod_ip}]
        return {
            "phase": self.phase(),
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.pod_ip,
            "podIPs": ips,
            "startTime": self.start_time,
            "conditions": [self._condition(kind, ok) for kind, ok in conditions.items()],
            "containerStatuses": [c.status() for c in self.containers],
        }

    def _condition(self, kind: str, ok: bool) -> dict[str, Any]:
        status = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, now_iso())
        return {"type": kind, "status": status, "lastTransitionTime": self._transitions[kind][1]}


def parse_entrypoint(text: str) -> tuple[str, list[str]]:
    """`IMAGE=COMMAND ...` (a --entrypoint flag) -> (image repository, argv)."""
    image, _, command = text.partition("=")
    return image_repository(image), shlex.split(command)
