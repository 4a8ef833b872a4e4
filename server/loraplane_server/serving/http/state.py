"""What every route shares: the config, the server's life (loading -> ready -> draining -> stopped, and the
requests in flight), the metrics, and the engine once it has loaded."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import traceback
from typing import Any

from fastapi import Request

from loraplane_server.engine.async_engine import AsyncEngine
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.engine.snapshot import EngineSnapshot
from loraplane_server.errors import AdapterLoadError, EngineShutdownError, RequestFailedError
from loraplane_server.platforms.device import DeviceError
from loraplane_server.platforms.torch_threads import engine_thread
from loraplane_server.serving.http.errors import ApiError, Rejected, api_error
from loraplane_server.serving.http.metrics import Metrics
from loraplane_server.serving.http.server_config import ServerConfig
from loraplane_server.spec.draft import DraftModelError
from loraplane_server.store.models import Progress, StartupListener
from loraplane_server.store.sources import ModelSourceError, scrub_secrets

log = logging.getLogger("loraplane.http")

# a server that failed to start answers /ready with the reason this long before it exits, so that a probe, the
# operator or a test can read it (the reason is also the last line of its stderr)
FAILED_LINGER_S = 2.0


class Phase(str, enum.Enum):
    LOADING = "loading"
    PREWARMING = "prewarming"  # loaded, out of rotation until the operator's prewarm is done (--prewarm-timeout)
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """The phase and the requests in flight. Admission control too: a generation request is admitted only while
    the model is loaded (ready, or prewarming), not draining, and fewer than `max_queue` requests wait for their
    first token. Event-loop only.

    With a prewarm gate (`prewarm_timeout_s` > 0) a loaded server is PREWARMING, not READY: /ready says 503 so
    that Kubernetes keeps the pod out of the Service and the router, while the operator prewarms the adapters
    placed on it; the operator then opens the gate (`open_gate`), or the server opens it itself after the
    timeout, so that an adapter that never loads cannot hold the pod out."""

    def __init__(self, max_queue: int, prewarm_timeout_s: float = 0.0) -> None:
        self.max_queue = max_queue
        self.prewarm_timeout_s = prewarm_timeout_s
        self.prewarm_since: float | None = None
        self.prewarm_outcome: str | None = None  # how the gate opened: "operator" or "timeout"
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
        """/ready's body: the phase; while loading, the start-up step and how long it has run; while prewarming,
        for how long and the timeout; once a gate opened, who opened it."""
        body: dict[str, object] = {"status": self.phase.value}
        if self.phase == Phase.LOADING:
            now = time.monotonic()
            body.update(
                step=self.step,
                step_seconds=round(now - self.step_since, 1),
                loading_seconds=round(now - self.started_at, 1),
            )
        elif self.phase == Phase.PREWARMING and self.prewarm_since is not None:
            body.update(
                prewarm_seconds=round(time.monotonic() - self.prewarm_since, 1),
                prewarm_timeout_seconds=self.prewarm_timeout_s,
            )
        elif self.phase == Phase.FAILED:
            body["error"] = self.error
        if self.prewarm_outcome is not None:  # ready behind a gate: who opened it (operator, or the timeout)
            body["prewarm"] = self.prewarm_outcome
        return body

    @property
    def is_ready(self) -> bool:
        return self.phase == Phase.READY

    def admit(self) -> None:
        """Count one more generation request in, or raise Rejected."""
        if self.phase == Phase.LOADING:
            raise Rejected(503, "loading", "the model is still loading; retry shortly")
        # PREWARMING admits: the model is loaded, and the gate only keeps the pod out of rotation
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
        """The model is loaded: READY, or PREWARMING behind the gate."""
        if self.phase != Phase.LOADING:
            return
        if self.prewarm_timeout_s > 0:
            self.phase, self.prewarm_since = Phase.PREWARMING, time.monotonic()
        else:
            self.phase = Phase.READY

    def open_gate(self, outcome: str) -> bool:
        """PREWARMING -> READY (the operator's word, or the timeout); False in any other phase."""
        if self.phase != Phase.PREWARMING:
            return False
        self.phase, self.prewarm_outcome = Phase.READY, outcome
        return True

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


class ServerState:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.lifecycle = Lifecycle(config.max_queue, config.prewarm_timeout_s)
        self.metrics = Metrics(config.model_name, config.metrics_top_adapters)
        self.engine: LLMEngine | None = None
        self.front: AsyncEngine | None = None
        self.special_ids: frozenset[int] = frozenset()
        self.model_progress = Progress(config.engine.model)  # /ready's "model"
        draft = config.engine.draft_model
        self.draft_progress = Progress(draft, "pending") if draft else None  # /ready's "draft_model"
        self._loads_seen = 0

    async def load(self) -> None:
        """Load the model off the event loop (so /health answers meanwhile), then mark the server ready."""
        listener = StartupListener(self._on_phase, self.model_progress, self.draft_progress)

        def build() -> LLMEngine:  # on the thread that will step it: one OpenMP team (async_engine)
            engine_thread(self.config.torch_threads)
            return LLMEngine(self.config.engine, listener)

        try:
            front = await asyncio.wrap_future(AsyncEngine.build(build))
        except (ModelSourceError, DraftModelError, DeviceError) as exc:  # a reason that says what to fix: no traceback
            self._fail(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - any failure to start is reported and ends the process
            log.error("the engine failed to start\n%s", scrub_secrets(traceback.format_exc().rstrip()))
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        engine = front.engine
        if engine.tokenizer is None:
            front.shutdown()
            self._fail(f"{engine.model_dir} has no tokenizer; the HTTP API needs one")
            return
        self.engine = engine
        engine.adapters.allow_sources(self.config.allowlist)  # binds every redirect of a remote source too
        self.special_ids = frozenset(engine.tokenizer.all_special_ids)
        self.front = front
        self.model_progress.set_phase("ready")
        if self.draft_progress is not None:
            self.draft_progress.set_phase("ready")
        self.lifecycle.mark_ready()
        if self.lifecycle.phase == Phase.PREWARMING:
            asyncio.get_running_loop().call_later(self.config.prewarm_timeout_s, self._prewarm_timed_out)
        log.info(
            "loraplane: %s ready (%s, %d KV blocks, %d adapters known)",
            self.config.model_name,
            engine.dtype,
            engine.inputs.blocks.num_blocks,
            engine.adapters.num_known,
        )

    def _prewarm_timed_out(self) -> None:
        if self.lifecycle.open_gate("timeout"):
            log.warning(
                "loraplane: no word that the prewarm is done in %.0fs (--prewarm-timeout); serving anyway",
                self.config.prewarm_timeout_s,
            )

    def _fail(self, reason: str) -> None:
        reason = scrub_secrets(" ".join(reason.split()))  # one line: it ends the server's stderr
        log.error("loraplane: failed to start: %s", reason)
        self.lifecycle.mark_failed(reason)

    def _on_phase(self, step: str) -> None:
        log.info("loraplane: starting: %s", step)
        self.lifecycle.set_step(step)

    def close(self) -> None:
        if self.front is not None:
            self.front.shutdown()
        if self.engine is not None:
            self.engine.adapters.shutdown()

    def require_engine(self) -> tuple[LLMEngine, AsyncEngine]:
        if self.engine is None or self.front is None:
            raise ApiError(
                503, "the model is still loading; retry shortly", code="loading", headers={"Retry-After": "1"}
            )
        return self.engine, self.front

    async def call(self, fn: Any) -> Any:
        """Run fn on the engine thread (503 while loading or after shutdown)."""
        _, front = self.require_engine()
        try:
            return await front.call(fn)
        except EngineShutdownError as exc:
            raise api_error(exc) from exc

    def public_error(self, failure: RequestFailedError | None) -> str:
        """A request's engine error as generation routes show it. With an admin token set, their callers
        need not be admins, and an adapter's load failure may name its source and server paths: they get
        a pointer to GET /v1/adapters (admin only), which keeps the reason."""
        if failure is None:
            return "the request failed"
        if self.config.admin_token is None or not isinstance(failure, AdapterLoadError):
            return str(failure)
        adapter_id = failure.adapter_id
        return f"adapter {adapter_id!r} failed to load; an admin can see the reason at GET /v1/adapters/{adapter_id}"

    async def snapshot(self) -> EngineSnapshot:
        engine, _ = self.require_engine()
        snap = await self.call(lambda: engine.snapshot(self._loads_seen))
        self._loads_seen = snap.num_loads_seen
        return snap


def get_state(request: Request) -> ServerState:
    return request.app.state.server
