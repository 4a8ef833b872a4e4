"""Server-sent events: encoding, and a streaming response that always closes its stream.

Starlette stops iterating when the client disconnects but leaves the body iterator suspended until
garbage collection; closing it here runs the route's `finally` at once, which aborts the request in
the engine and frees its KV blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplane_server.http.errors import error_body

log = logging.getLogger("loraplane.http")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str) -> bytes:
    """One `data:` event. JSON has no NaN or Infinity: such a value raises rather than reach a client."""
    payload = (
        data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    )
    return f"data: {payload}\n\n".encode()


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self._events = events
        self._guarded_events = self._guarded(events)
        self._path = ""
        super().__init__(self._guarded_events, headers={**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._path = scope.get("path", "")
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._guarded_events.aclose()  # type: ignore[attr-defined]
            await self._events.aclose()  # type: ignore[attr-defined]

    async def _guarded(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The events; an unexpected error ends the stream with an error event, so the connection stays usable
        (an exception out of a started response makes uvicorn drop the connection)."""
        try:
            async for event in events:
                yield event
        except Exception as exc:
            log.exception("unhandled error in the stream of %s", self._path)
            yield sse(error_body(self._path, 500, f"internal error: {type(exc).__name__}", code="internal_error"))
