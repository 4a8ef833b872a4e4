"""torch's CPU threads: one OpenMP thread team in a serving process (why: async_engine's docstring)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

# torch's own default (one per core), read when this module is first imported
DEFAULT_THREADS = torch.get_num_threads()


def engine_thread(threads: int = 0) -> None:
    """The calling thread runs the engine's ops on `threads` threads (0: torch's default)."""
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
