"""Abort non-streaming generations whose client went away (streams are closed by SSEResponse).

Once the request body is read, the next ASGI receive() only returns when the connection closes, so
waiting on it costs nothing while the generation runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request

from loraplane_server.http.generation import Generation


@asynccontextmanager
async def abort_on_disconnect(request: Request, gens: list[Generation]) -> AsyncIterator[None]:
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for gen in gens:
            gen.abort()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
