"""torch's CPU threads: one OpenMP thread team in a serving process (why: async_engine's docstring)."""

from __future__ import annotations

import torch

# torch's own default (one per core), read when this module is first imported: torch.set_num_threads also
# changes the default of every thread that has not run a torch op yet, and serial_torch_thread calls it
DEFAULT_THREADS = torch.get_num_threads()


def engine_thread(threads: int = 0) -> None:
    """The calling thread runs the engine's ops on `threads` threads (0: torch's default)."""
    torch.set_num_threads(threads or DEFAULT_THREADS)


def serial_torch_thread() -> None:
    """The calling thread runs its torch ops alone, so that it never starts a second OpenMP team (a
    long-lived helper thread, such as an adapter loader)."""
    torch.set_num_threads(1)
