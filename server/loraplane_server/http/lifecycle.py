"""The server's life: loading -> ready -> draining -> stopped, and the requests in flight.

Admission control lives here too: a generation request is admitted only while the server is ready,
not draining, and fewer than `max_queue` requests wait for their first token. Event-loop only.
"""

from __future__ import annotations

import enum
import time

# a server that failed to start answers /ready with the reason this long before it exits, so that a probe, the
# operator or a test can read it (the reason is also the last line of its stderr)
FAILED_LINGER_S = 2.0


class Phase(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Rejected(Exception):
    """A request refused at the door: status 429 (queue full) or 503 (loading, draining, failed)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class Lifecycle:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.phase = Phase.LOADING
        self.error: str | None = None
        self.failed_at: float | None = None
        self.num_waiting = 0  # admitted, no first token yet
        self.num_inflight = 0  # admitted, not finished
        self.drain_deadline: float | None = None
        self.started_at = time.monotonic()
        self.step = "starting"  # what start-up is doing now (LLMEngine's on_phase), for /ready and logs
        self.step_since = self.started_at

    def set_step(self, step: str) -> None:
        """Start-up moved on to `step`. Called from the loading thread: two plain assignments, read
        by /ready on the event loop (a reader may pair the new step with the old time, never worse)."""
        self.step, self.step_since = step, time.monotonic()

    def progress(self) -> dict[str, object]:
        """/ready's body: the phase and, while loading, the start-up step and how long it has run."""
        body: dict[str, object] = {"status": self.phase.value}
        if self.phase == Phase.LOADING:
            now = time.monotonic()
            body.update(
                step=self.step,
                step_seconds=round(now - self.step_since, 1),
                loading_seconds=round(now - self.started_at, 1),
            )
        elif self.phase == Phase.FAILED:
            body["error"] = self.error
        return body

    @property
    def is_ready(self) -> bool:
        return self.phase == Phase.READY

    def admit(self) -> None:
        """Count one more generation request in, or raise Rejected."""
        if self.phase == Phase.LOADING:
            raise Rejected(503, "loading", "the model is still loading; retry shortly")
        if self.phase == Phase.DRAINING:
            raise Rejected(503, "draining", "the server is shutting down; send this request to another replica")
        if self.phase == Phase.FAILED:
            raise Rejected(503, "failed", f"the server failed to start: {self.error}")
        if self.num_waiting >= self.max_queue:
            raise Rejected(
                429,
                "queue_full",
                f"{self.num_waiting} requests are already waiting (--max-queue {self.max_queue}); retry later",
            )
        self.num_waiting += 1
        self.num_inflight += 1

    def started(self) -> None:
        """An admitted request got its first token (or failed before it)."""
        self.num_waiting -= 1

    def finished(self) -> None:
        self.num_inflight -= 1

    def mark_ready(self) -> None:
        if self.phase == Phase.LOADING:
            self.phase = Phase.READY

    def mark_failed(self, error: str) -> None:
        self.phase, self.error, self.failed_at = Phase.FAILED, error, time.monotonic()

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting; in-flight requests have grace_s seconds to finish."""
        if self.phase != Phase.DRAINING:
            self.phase = Phase.DRAINING
            self.drain_deadline = time.monotonic() + grace_s

    @property
    def can_exit(self) -> bool:
        """Draining and done (or out of time), or failed to start (FAILED_LINGER_S ago)."""
        if self.phase == Phase.FAILED:
            return self.failed_at is None or time.monotonic() - self.failed_at >= FAILED_LINGER_S
        if self.phase != Phase.DRAINING or self.drain_deadline is None:
            return False
        return self.num_inflight == 0 or time.monotonic() >= self.drain_deadline
