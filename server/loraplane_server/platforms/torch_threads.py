"""torch's CPU threads: one OpenMP thread team in a serving process (why: async_engine's docstring)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP) -> float | None:
    """The CPUs this process's cgroup may use (its CFS quota / period: a Kubernetes CPU limit), or None where
    there is no limit. cgroup v2's cpu.max ("max 100000" or "200000 100000"), else v1's cfs_quota_us."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def default_threads(torch_default: int, quota: float | None) -> int:
    """torch's default (a thread per core it may run on), at most the CPU quota rounded up: a pod limited to 2
    CPUs on a 64-core node would otherwise start 64 threads, each region waiting on the ones CFS throttled."""
    return torch_default if quota is None else max(1, min(torch_default, math.ceil(quota - 1e-9)))


# read when this module is first imported
DEFAULT_THREADS = default_threads(torch.get_num_threads(), cpu_quota())


def engine_thread(threads: int = 0) -> None:
    """The calling thread runs the engine's ops on `threads` threads (0: DEFAULT_THREADS)."""
    torch.set_num_threads(threads or DEFAULT_THREADS)


def serial_torch_thread() -> None:
    """The calling thread runs its torch ops alone, so that it never starts a second OpenMP team (a
    long-lived helper thread, such as an adapter loader). This thread's OpenMP count only: torch.set_num_threads
    also sets the process-wide count that torch re-applies, and with it in the adapter loaders the engine's
    workload (b) over HTTP fell from 888 to 549 tok/s (bench/peers.py, Zen 4)."""
    torch.get_num_threads()  # torch's once-per-thread set-up first, so that it does not undo what follows
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """The OpenMP runtime's omp_set_num_threads (the one torch loaded), or None where there is none."""
    for lib in (None, *_loaded_openmp_runtimes()):
        try:
            return ctypes.CDLL(lib).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def _loaded_openmp_runtimes() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))
