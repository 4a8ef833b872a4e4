"""The FastAPI app and how it runs: routes, error handlers, middlewares (body-size limit, the admin port's
routes, catch-all) and a lifespan that loads the engine; `serve` runs it under uvicorn with a graceful SIGTERM drain.

The model loads in the background so /health answers at once; /ready turns 200 when it is loaded.

uvicorn alone closes its sockets on SIGTERM (new requests are refused, /ready cannot say 503) and
re-raises the signal after shutdown (exit status 143). Here the first SIGTERM or SIGINT only starts
the drain: /ready and new generation requests answer 503 while requests in flight finish, for up to
the grace period; then uvicorn shuts down normally. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplane_server.serving.http import admin, health, lorax, openai
from loraplane_server.serving.http.errors import error_body, install_handlers
from loraplane_server.serving.http.server_config import ServerConfig
from loraplane_server.serving.http.state import Lifecycle, Phase, ServerState

log = logging.getLogger("loraplane.http")


def create_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load())
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()  # the load thread runs on; the process is exiting anyway
            await asyncio.to_thread(state.close)

    app = FastAPI(
        title="loraplane",
        version="0.1.0",
        lifespan=lifespan,
        description="Many LoRA fine-tunes of one base model: LoRAX, OpenAI and vLLM-compatible APIs.",
    )
    app.state.server = state
    install_handlers(app)
    for module in (lorax, openai, admin, health):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.admin_port is not None:
        app.add_middleware(AdminPort, admin_port=config.admin_port)
    app.add_middleware(CatchAll)  # outermost of ours: also catches what BodyLimit raises
    return app


class AdminPort:
    """ASGI middleware with --admin-port: the admin routes answer on that port only, and it serves nothing else
    but the probes, so that a NetworkPolicy on the port (the operator's) can say who may manage adapters while
    clients reach the API port. Elsewhere: a 404 that says where to go."""

    PROBES = frozenset({"/health", "/ready", "/metrics"})

    def __init__(self, app: ASGIApp, admin_port: int) -> None:
        self.app = app
        self.admin_port = admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in self.PROBES:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        on_admin_port = (scope.get("server") or (None, None))[1] == self.admin_port
        if admin.is_admin_path(path) == on_admin_port:
            await self.app(scope, receive, send)
            return
        where = f"the admin port ({self.admin_port})" if not on_admin_port else "the API port"
        body = error_body(path, 404, f"{path} is served on {where}", code="wrong_port")
        await JSONResponse(body, status_code=404)(scope, receive, send)


# middlewares
class _TooLarge(HTTPException):
    """Raised from receive(); an HTTPException so that FastAPI's body parsing lets it through as a 413."""


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is refused with 413, before it is parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            status = 413 if length.isdigit() else 400
            await self._refuse(scope, send, status)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(413, f"the request body is larger than {self.max_bytes} bytes")
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, send, 413)

    async def _refuse(self, scope: Scope, send: Send, status: int) -> None:
        message = (
            f"the request body is larger than {self.max_bytes} bytes"
            if status == 413
            else "invalid Content-Length header"
        )
        body = json.dumps(error_body(scope.get("path", ""), status, message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class CatchAll:
    """ASGI middleware: an unexpected exception becomes a JSON 500 and goes no further.

    Starlette's own handler for Exception (ServerErrorMiddleware) re-raises after answering, and uvicorn
    then closes the kept-alive connection, so the client's next request on it is reset. Once a response
    has started (a stream) there is nothing to answer with; closing the connection is then the only signal.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            path = scope.get("path", "")
            body = error_body(path, 500, f"internal error: {type(exc).__name__}", code="internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)


# serve
class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.phase not in (Phase.READY, Phase.PREWARMING):
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


def listen(host: str, port: int) -> socket.socket:
    """A bound socket for uvicorn (which takes several, one per port: the API's and the admin's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds --host (localhost: IPv4)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


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
    ports = [config.port] if config.admin_port is None else [config.port, config.admin_port]
    try:
        sockets = [listen(config.host, port) for port in ports]
    except OSError as exc:
        print(f"loraplane: failed to start: cannot listen on {config.host}:{ports}: {exc}", file=sys.stderr, flush=True)
        return 1
    server.run(sockets=sockets)
    if lifecycle.phase == Phase.FAILED:
        logging.shutdown()  # flush the log first: this line is the last one on stderr (a pod's termination message)
        print(f"loraplane: failed to start: {lifecycle.error}", file=sys.stderr, flush=True)
        return 1
    return 0
