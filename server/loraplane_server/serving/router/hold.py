"""The router's waiting room for a pool with no Ready pod (scaled to zero, or every pod restarting).

A request that finds no Ready pod waits here, up to `timeout_s`, for the pool's next poll that finds one; at
most `max_held` wait at once (the next is refused at once). The number held is what wakes a pool at zero: the
router exports it (`loraplane_router_held_requests`) and the operator's KEDA ScaledObject activates the
servers' Deployment on it. Pure asyncio, one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class HoldFull(Exception):
    """`max_held` requests already wait."""


class Hold:
    def __init__(self, max_held: int, timeout_s: float) -> None:
        if max_held < 0 or timeout_s < 0:
            raise ValueError("--hold-max and --hold-timeout must be >= 0")
        self.max_held, self.timeout_s = max_held, timeout_s
        self.held = 0
        self._changed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.max_held > 0 and self.timeout_s > 0

    def wake(self) -> None:
        """The pool changed: every waiter looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, find: Callable[[], T | None]) -> tuple[T | None, float]:
        """`find()` once it returns something within the timeout (None after it) and the seconds waited.
        Raises HoldFull when `max_held` already wait."""
        if self.held >= self.max_held:
            raise HoldFull
        start = time.monotonic()
        deadline = start + self.timeout_s
        self.held += 1
        try:
            while (found := find()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass
            return found, time.monotonic() - start
        finally:
            self.held -= 1
