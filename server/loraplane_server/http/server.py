"""Run the app under uvicorn with a graceful SIGTERM: stop being ready, drain, then exit 0.

uvicorn alone closes its sockets on SIGTERM (new requests are refused, /ready cannot say 503) and
re-raises the signal after shutdown (exit status 143). Here the first SIGTERM or SIGINT only starts
the drain: /ready and new generation requests answer 503 while requests in flight finish, for up to
the grace period; then uvicorn shuts down normally. A second signal stops at once.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType

import uvicorn

from loraplane_server.http.app import create_app
from loraplane_server.http.lifecycle import Lifecycle, Phase
from loraplane_server.http.server_config import ServerConfig

log = logging.getLogger("loraplane.http")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.phase != Phase.READY:
            self.should_exit = True  # a second signal, or nothing to drain (loading, failed)
            return
        log.info(
            "loraplane: signal %d, draining %d requests (grace %.0fs)", sig, self.lifecycle.num_inflight, self.grace_s
        )
        self.lifecycle.begin_drain(self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.can_exit:
            self.should_exit = True
        return await super().on_tick(counter)


def serve(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean drain, 1 if the engine failed to start (its last line
    on stderr then reads `loraplane: failed to start: <reason>`)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    lifecycle: Lifecycle = app.state.server.lifecycle
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
        access_log=config.log_level == "debug",
    )
    server = GracefulServer(uv_config, lifecycle, config.shutdown_grace_s)
    server.run()
    if lifecycle.phase == Phase.FAILED:
        logging.shutdown()  # flush the log first: this line is the last one on stderr (a pod's termination message)
        print(f"loraplane: failed to start: {lifecycle.error}", file=sys.stderr, flush=True)
        return 1
    return 0
