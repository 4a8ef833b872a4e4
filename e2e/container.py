"""One container of a pod as a local process: start, exit bookkeeping, restart backoff, probes, status; and an
init container, which runs to completion before the others."""

from __future__ import annotations

import datetime
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from e2e.probe import ProbeState, probe_once
from e2e.process import signal_group, spawn, stop

MAX_BACKOFF_SECONDS = 10.0
# the real kubelet's bounds: a termination message file is read up to 4 KiB; FallbackToLogsOnError takes
# the last 80 lines of the log, then at most their last 2 KiB
MAX_MESSAGE_BYTES = 4096
MAX_LOG_LINES = 80
MAX_LOG_BYTES = 2048


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Container:
    """Owned by the kubelet's sync loop; a daemon thread runs the probes while the process lives."""

    def __init__(self, spec: dict[str, Any], log_path: Path, termination_file: Path | None = None) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.log_path = log_path
        self.termination_file = termination_file or log_path.with_name(f"{self.name}.termination-log")
        self._log_offset = 0  # where this run's output starts in the log (restarts append to it)
        self.process: subprocess.Popen[bytes] | None = None
        self.restart_count = 0
        self.started_at: str | None = None
        self.terminated: dict[str, Any] | None = None  # the last exit, as a containerStatus state
        self.waiting: dict[str, str] | None = {"reason": "ContainerCreating"}
        self.restart_at = 0.0
        self._num_starts = 0
        self._lock = threading.Lock()
        self._stop_probes = threading.Event()
        self._readiness: ProbeState | None = None
        self._startup: ProbeState | None = None

    # process

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, pod_ip: str) -> None:
        if self._num_starts:
            self.restart_count += 1
        self._num_starts += 1
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.termination_file.parent.mkdir(parents=True, exist_ok=True)
        self.termination_file.write_bytes(b"")
        self.process = spawn(argv, self.log_path, env=env, cwd=cwd)
        self.started_at, self.waiting = now_iso(), None
        self._start_probes(pod_ip, env)

    def fail_to_start(self, reason: str, message: str) -> None:
        """CreateContainerConfigError and friends: retried after the backoff."""
        self.waiting = {"reason": reason, "message": message[:1000]}
        self.restart_at = time.monotonic() + MAX_BACKOFF_SECONDS / 2

    def reap(self, restart_policy: str) -> bool:
        """Notices an exit; True when the state changed. Schedules a restart with a backoff if the policy says so."""
        if self.process is None or (code := self.process.poll()) is None:
            return False
        self._stop_probes.set()
        signal_group(self.process, signal.SIGKILL)  # what the main process left behind dies with the container
        self.process = None
        self.terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": self.started_at,
            "finishedAt": now_iso(),
        }
        if message := self.termination_message(code):
            self.terminated["message"] = message
        if restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0):
            backoff = min(2.0**self.restart_count, MAX_BACKOFF_SECONDS)
            self.restart_at = time.monotonic() + backoff
            self.waiting = {"reason": "CrashLoopBackOff", "message": f"back-off {backoff:.0f}s restarting {self.name}"}
        return True

    def termination_message(self, exit_code: int) -> str:
        """The terminationMessagePath file's text; under FallbackToLogsOnError, when that is empty and the
        container failed, the tail of this run's log."""
        text = _read_from(self.termination_file, 0)[:MAX_MESSAGE_BYTES].decode(errors="replace")
        if text or exit_code == 0 or self.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return text
        lines = _read_from(self.log_path, self._log_offset).splitlines(keepends=True)[-MAX_LOG_LINES:]
        return b"".join(lines)[-MAX_LOG_BYTES:].decode(errors="replace")

    def is_due(self, now: float) -> bool:
        """Waiting to (re)start and the backoff is over."""
        return self.process is None and self.waiting is not None and now >= self.restart_at

    def stop(self, grace_seconds: float) -> None:
        self._stop_probes.set()
        if self.process is not None:
            stop(self.process, grace_seconds)

    # status

    @property
    def is_running(self) -> bool:
        return self.process is not None

    @property
    def is_ready(self) -> bool:
        with self._lock:
            startup_ok = self._startup is None or self._startup.is_passing
            return self.is_running and startup_ok and (self._readiness is None or self._readiness.is_passing)

    def status(self) -> dict[str, Any]:
        state: dict[str, Any]
        if self.process is not None:
            state = {"running": {"startedAt": self.started_at}}
        elif self.waiting is not None:
            state = {"waiting": self.waiting}
        else:
            state = {"terminated": self.terminated}
        last_state = {"terminated": self.terminated} if self.terminated and "terminated" not in state else {}
        with self._lock:
            started = self.is_running and (self._startup is None or self._startup.is_passing)
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "containerID": f"process://{self.process.pid}" if self.process else "",
            "state": state,
            "lastState": last_state,
            "ready": self.is_ready,
            "started": started,
            "restartCount": self.restart_count,
        }

    # probes

    def _start_probes(self, pod_ip: str, env: dict[str, str]) -> None:
        self._stop_probes = threading.Event()
        begin = time.monotonic()

        def state(kind: str, is_passing: bool) -> ProbeState | None:
            probe = self.spec.get(kind)
            if probe is None:
                return None
            return ProbeState(probe, is_passing, next_at=begin + float(probe.get("initialDelaySeconds", 0)))

        with self._lock:
            self._startup, self._readiness = state("startupProbe", False), state("readinessProbe", False)
        liveness = state("livenessProbe", True)
        if self._startup or self._readiness or liveness:
            args = (self.process, self._stop_probes, pod_ip, env, liveness)
            threading.Thread(target=self._probe_loop, args=args, name=f"probe-{self.name}", daemon=True).start()

    def _probe_loop(
        self,
        process: subprocess.Popen[bytes],
        stop_event: threading.Event,
        pod_ip: str,
        env: dict[str, str],
        liveness: ProbeState | None,
    ) -> None:
        while not stop_event.wait(0.2):
            with self._lock:
                startup, readiness = self._startup, self._readiness
            if startup is not None and not startup.is_passing:
                states = [startup]
            else:
                states = [s for s in (liveness, readiness) if s is not None]
            for probe_state in states:
                if time.monotonic() < probe_state.next_at:
                    continue
                ok = probe_once(probe_state.probe, pod_ip, self.spec, env)
                with self._lock:
                    probe_state.record(ok)
                probe_state.next_at = time.monotonic() + probe_state.period
                if probe_state is not readiness and probe_state.has_failed:  # liveness or startup
                    signal_group(process, signal.SIGKILL)  # the sync loop reaps it and restarts it
                    return


class InitContainer(Container):
    """An init container: no probes (the API refuses them), and ready only once it completed, as the kubelet says."""

    def _start_probes(self, pod_ip: str, env: dict[str, str]) -> None:
        self._stop_probes = threading.Event()  # a fresh event, so `reap` and `stop` work as for the others

    @property
    def has_completed(self) -> bool:
        """Exited 0 and not to be run again: the next init container (or the pod's containers) may start."""
        return self._final_exit_code() == 0

    @property
    def has_failed(self) -> bool:
        """Exited non-zero and no restart is due (restartPolicy Never): the pod has failed."""
        return self._final_exit_code() not in (None, 0)

    def _final_exit_code(self) -> int | None:
        """The last run's exit code once it is neither running nor waiting to run again."""
        if self.process is not None or self.waiting is not None or self.terminated is None:
            return None
        return int(self.terminated["exitCode"])

    @property
    def is_ready(self) -> bool:
        return self.has_completed


def _read_from(path: Path, start: int) -> bytes:
    """The bytes of `path` from offset `start`; nothing when it does not exist."""
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            return handle.read()
    except OSError:
        return b""
