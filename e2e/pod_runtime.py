"""One pod on the process kubelet: its loopback IP, directory, init containers, containers and status."""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.api import ApiError
from e2e.container import Container, InitContainer, now_iso
from e2e.container_env import ConfigError, expand
from e2e.process import signal_group
from e2e.volumes import MountTable, VolumeError

# Builds a container's environment; raises ConfigError when a referenced object is missing.
EnvBuilder = Callable[[dict[str, Any], dict[str, Any]], dict[str, str]]
# Volume name -> host directory for a pod; raises VolumeError while a volume cannot be set up.
VolumeResolver = Callable[[dict[str, Any]], dict[str, Path]]
# the kubelet's waiting reason for every container of a pod with init containers until it starts (kubectl then
# prints the pod as Init:i/n rather than Init:ContainerCreating)
POD_INITIALIZING = "PodInitializing"
SIDECAR_UNSUPPORTED = "sidecar init containers (restartPolicy: Always) are not supported by the process kubelet"


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
        init_specs = pod["spec"].get("initContainers") or []
        self.init_containers = [InitContainer(c, directory / f"{c['name']}.log") for c in init_specs]
        self.containers = [Container(c, directory / f"{c['name']}.log") for c in pod["spec"]["containers"]]
        self.is_initialized = not self.init_containers  # stays True: a container's restart does not rerun init
        self._not_started_reason = POD_INITIALIZING if self.init_containers else "ContainerCreating"
        for container in self.all_containers:
            container.waiting = {"reason": self._not_started_reason}
        self.is_terminating = False
        self.is_stopped = False
        self._transitions: dict[str, tuple[str, str]] = {}  # condition type -> (status, lastTransitionTime)
        self.mounts: dict[str, MountTable] | None = None  # container name -> its mounts, once volumes are set up
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def all_containers(self) -> list[Container]:
        return [*self.init_containers, *self.containers]

    def sync(self, pod: dict[str, Any], build: EnvBuilder, resolve_volumes: VolumeResolver | None = None) -> None:
        """Sets up the volumes once, runs the init containers to completion, then reaps exited processes and
        (re)starts the containers that are due."""
        self.pod = pod
        if self.mounts is None and not self._set_up_volumes(resolve_volumes):
            return
        now = time.monotonic()
        if not self.is_initialized and not self._sync_init(build, now):
            return
        for container in self.containers:
            container.reap(self.restart_policy)
            if not self.is_terminating and container.is_due(now):
                self._start(container, build)

    def _sync_init(self, build: EnvBuilder, now: float) -> bool:
        """Runs the init containers one at a time, in order, each to completion; True once all have completed.
        A failed one is retried with the backoff unless the pod's restartPolicy is Never."""
        policy = "Never" if self.restart_policy == "Never" else "OnFailure"  # one that exited 0 is done for good
        for container in self.init_containers:
            container.reap(policy)
            if container.has_completed:
                continue
            if self.is_terminating or not container.is_due(now):
                return False
            if container.spec.get("restartPolicy") == "Always":  # it would never complete: say so, not hang
                container.fail_to_start("CreateContainerError", SIDECAR_UNSUPPORTED)
            else:
                self._start(container, build)
            return False
        self.is_initialized = True
        return True

    def _set_up_volumes(self, resolve: VolumeResolver | None) -> bool:
        """True once every volume has a host directory; until then the containers wait, saying why."""
        try:
            dirs = resolve(self.pod) if resolve is not None else {}
        except VolumeError as error:
            message = f"waiting for volumes: {error}"
            for container in self.all_containers:
                container.waiting = {"reason": self._not_started_reason, "message": message}
            return False
        containers = self.all_containers
        self.mounts = {c.name: MountTable.for_container(c.spec, dirs, c.termination_file) for c in containers}
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
        """SIGTERM every container (a running init container too) at once, then stop each within what is left of
        the grace period."""
        self.is_terminating = True
        deadline = time.monotonic() + grace_seconds
        for container in self.all_containers:
            if container.process is not None:
                signal_group(container.process, signal.SIGTERM)
        for container in self.all_containers:
            container.stop(max(0.0, deadline - time.monotonic()))
        self.is_stopped = True

    # status

    def phase(self) -> str:
        if not self.is_initialized:  # as the kubelet's getPhase: a failed init container fails only a Never pod
            has_failed = self.restart_policy == "Never" and any(c.has_failed for c in self.init_containers)
            return "Failed" if has_failed else "Pending"
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
            "Initialized": self.is_initialized,
            "ContainersReady": ready,
            "Ready": ready,
            "PodScheduled": True,
        }
        incomplete = " ".join(c.name for c in self.init_containers if not c.has_completed)
        why = {"Initialized": ("ContainersNotInitialized", f"containers with incomplete status: [{incomplete}]")}
        ips = [{"ip": self.pod_ip}]
        status = {
            "phase": self.phase(),
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.pod_ip,
            "podIPs": ips,
            "startTime": self.start_time,
            "conditions": [self._condition(kind, ok, *why.get(kind, ("", ""))) for kind, ok in conditions.items()],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        return status

    def _condition(self, kind: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        """A pod condition; `reason` and `message` say why when it is False."""
        status = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, now_iso())
        condition = {"type": kind, "status": status, "lastTransitionTime": self._transitions[kind][1]}
        if not ok and reason:
            condition.update(reason=reason, message=message)
        return condition


def parse_entrypoint(text: str) -> tuple[str, list[str]]:
    """`IMAGE=COMMAND ...` (a --entrypoint flag) -> (image repository, argv)."""
    image, _, command = text.partition("=")
    return image_repository(image), shlex.split(command)
