"""Child processes that cannot outlive their parent: own process group, SIGKILL on parent death."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. The signal fires when the *thread* that forked
    # exits, so spawn only from long-lived threads.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` with stdout and stderr appended to `log_path`, in a new process group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def stop(process: subprocess.Popen[bytes], grace_seconds: float = 10.0) -> int:
    """SIGTERM the process group, wait up to `grace_seconds`, then SIGKILL it; returns the exit code."""
    if process.poll() is None:
        signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            pass
    signal_group(process, signal.SIGKILL)  # leftovers in the group, even if the leader exited
    return process.wait()


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
