"""The FastAPI app: routes, error handlers, the body-size limit, and a lifespan that loads the engine.

The model loads in the background so /health answers at once; /ready turns 200 when it is loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplane_server.http import routes_admin, routes_chat, routes_completions, routes_health, routes_lorax
from loraplane_server.http.body_limit import BodyLimit
from loraplane_server.http.errors import CatchAll, install_handlers
from loraplane_server.http.server_config import ServerConfig
from loraplane_server.http.state import ServerState


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
    for module in (routes_lorax, routes_completions, routes_chat, routes_admin, routes_health):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(CatchAll)  # outermost of ours: also catches what BodyLimit raises
    return app
