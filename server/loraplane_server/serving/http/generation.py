"""One request's generations, from admission to its client: as server-sent events or one JSON body.

Every route builds a Generation per choice, starts them together (errors before the first token become
status codes), iterates events() and always closes them: closing the engine stream aborts an unfinished
request at once (its KV blocks are freed) and the request is counted in the metrics exactly once.

Several generations may answer one request (OpenAI's n > 1, or a batch of prompts); they start and close
together. Starlette stops iterating a stream when the client disconnects but leaves the body iterator suspended
until garbage collection; SSEResponse closes it at once, which runs the route's `finally`, aborts the request in
the engine and frees its KV blocks. A non-streaming request learns of a disconnect from abort_on_disconnect:
once the request body is read, the next ASGI receive() only returns when the connection closes, so waiting on it
costs nothing while the generation runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplane_server.engine.input_processor import CheckedPrompt
from loraplane_server.engine.llm_engine import RequestOutput
from loraplane_server.errors import EngineError, RequestFailedError
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.serving.http.errors import ApiError, Rejected, api_error, error_body, rejected_error
from loraplane_server.serving.http.state import ServerState


@dataclass
class TokenEvent:
    """What one engine output adds: a token (None for a final output without one) and its text."""

    token_id: int | None
    text: str
    logprob: float | None
    special: bool
    finished: bool
    finish_reason: str | None  # engine's: stop | length | abort | error
    error: str | None = None
    top: list[tuple[int, float]] | None = None  # top_logprobs > 0: the most likely tokens (finite ones), best first


class Generation:
    def __init__(
        self,
        state: ServerState,
        api: str,
        prompt: CheckedPrompt | list[int],
        params: SamplingParams,
        adapter_id: str | None,
        arrival: float | None = None,
    ) -> None:
        """prompt: as the routes' check_budget checked it (the engine does not check it again), or token ids
        the engine checks, its typed error then coming back from start()."""
        self.state = state
        self.api = api
        self.request_id = f"{api}-{uuid.uuid4().hex}"
        self.prompt = prompt
        self.prompt_ids = prompt.token_ids if isinstance(prompt, CheckedPrompt) else prompt
        self.params = params
        self.adapter_id = adapter_id
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per output token, when params.top_logprobs > 0
        # params.prompt_logprobs: prompt positions 1.. as (token id, logprob, rank, alternatives)
        self.prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
        self._pieces: list[str] = []  # the engine's text deltas, joined when text is read
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.failure: RequestFailedError | None = None
        self.first_token_time: float | None = None
        self.end_time: float | None = None
        self._last_token_time: float | None = None
        self._first: RequestOutput | None = None
        self._stream: AsyncIterator[RequestOutput] | None = None
        self._admitted = False
        self._start_failed = False
        self._closed = False
        self._speculation = (0, 0, 0)  # tokens proposed, accepted, verifying passes (the latest output's)

    # lifecycle
    async def start(self) -> None:
        """Admit the request and wait for its first output; raise ApiError for every failure."""
        _, front = self.state.require_engine()
        try:
            self.state.lifecycle.admit()
        except Rejected as exc:
            self.state.metrics.rejected.labels(exc.reason).inc()
            raise rejected_error(exc) from exc
        self._admitted = True
        self._start_failed = True  # until the first output says otherwise
        self._stream = front.generate(self.prompt, self.params, self.request_id, self.adapter_id)
        try:
            self._first = await anext(self._stream)
        except EngineError as exc:
            raise api_error(exc) from exc
        finally:
            self.state.lifecycle.started()
        if self._first.finish_reason == "error" and not self._first.token_ids:
            error = self.state.public_error(self._first.failure)
            raise ApiError(400, error, code="adapter_load_failed")
        self._start_failed = False

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Token events from the first output on; the last has finished=True (unless the stream is closed)."""
        assert self._first is not None and self._stream is not None, "start() first"
        first, self._first = self._first, None
        yield self._event(first)
        if first.finished:
            return
        async for out in self._stream:
            yield self._event(out)
            if out.finished:
                return

    def abort(self) -> None:
        """Stop the request in the engine now; its stream then ends with finish_reason "abort"."""
        if self._stream is not None and self.state.front is not None:
            self.state.front.abort(self.request_id)

    async def close(self) -> None:
        """Abort if unfinished, free the admission, record the metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            await self._stream.aclose()  # type: ignore[attr-defined]
        if not self._admitted:
            return
        self.state.lifecycle.finished()
        if self._start_failed:
            self.state.metrics.requests.labels(self.api, "error").inc()
            return
        now = time.monotonic()
        self.end_time = self.end_time or now
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        self.state.metrics.record_request(
            self.api,
            self.adapter_id,
            self.finish_reason or "abort",
            len(self.prompt_ids),
            len(self.token_ids),
            ttft,
            self.end_time - self.arrival,
        )
        method = self.params.speculative or self.state.config.engine.speculative
        self.state.metrics.record_speculation(self.adapter_id, method, *self._speculation)

    def _event(self, out: RequestOutput) -> TokenEvent:
        now = time.monotonic()
        token = out.delta_token_ids[-1] if out.delta_token_ids else None
        logprob, top = None, None
        if token is not None:
            self.token_ids.append(token)
            if (self.params.logprobs or self.params.top_logprobs) and out.delta_logprobs:
                logprob = finite(out.delta_logprobs[-1])
            self.logprobs.append(logprob)
            if self.params.top_logprobs:
                # a token a grammar or a -100 bias forbids has logprob -inf: JSON has no such number, and it is
                # no alternative
                top = [(t, lp) for t, lp in (out.delta_top_logprobs or [[]])[-1] if math.isfinite(lp)]
                self.top_logprobs.append(top)
            if self._last_token_time is not None:
                self.state.metrics.itl.observe(now - self._last_token_time)
            self._last_token_time = now
            self.first_token_time = self.first_token_time or now
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        piece = out.delta_text  # held back by the engine until safe to show: the pieces add up to the final text
        self._pieces.append(piece)
        self._speculation = (out.num_spec_proposed, out.num_spec_accepted, out.num_spec_steps)
        if out.finished:
            self.finish_reason, self.error, self.failure = out.finish_reason, out.error, out.failure
            self.end_time = now
        special = token is not None and token in self.state.special_ids
        return TokenEvent(token, piece, logprob, special, out.finished, out.finish_reason, out.error, top)

    # reporting
    @property
    def text(self) -> str:
        """The text generated so far (the final text once finished)."""
        return "".join(self._pieces)

    def raise_if_failed(self) -> None:
        """A finished non-streaming request that did not finish normally: its error as a status code."""
        if self.finish_reason == "error":  # the engine fails a request only for its adapter or its values
            error = self.state.public_error(self.failure)
            raise ApiError(422, f"generation failed: {error}", code="generation_failed")
        if self.finish_reason in (None, "abort"):
            raise ApiError(
                503,
                "the request was aborted (the server is shutting down)",
                code="aborted",
                headers={"Retry-After": "1"},
            )

    @property
    def is_eos(self) -> bool:
        engine = self.state.engine
        return bool(self.token_ids) and engine is not None and self.token_ids[-1] in engine.eos_token_ids

    def headers(self) -> dict[str, str]:
        """LoRAX-style timing headers; milliseconds. Total time and counts only once finished."""
        h = {
            "x-request-id": self.request_id,
            "x-adapter-id": self.adapter_id or self.state.config.model_name,
            "x-prompt-tokens": str(len(self.prompt_ids)),
        }
        if self.first_token_time is not None:
            h["x-time-to-first-token"] = _ms(self.first_token_time - self.arrival)
        if self.finish_reason is not None and self.end_time is not None:
            n = len(self.token_ids)
            per_token = (self.end_time - (self.first_token_time or self.end_time)) / max(1, n - 1)
            ttft = (self.first_token_time or self.end_time) - self.arrival
            h["x-generated-tokens"] = str(n)
            h["x-total-time"] = _ms(self.end_time - self.arrival)
            h["x-time-per-token"] = _ms(per_token)
            # the engine does not report when a request was first scheduled: estimate the prefill as one step
            h["x-queue-time"] = _ms(max(0.0, ttft - per_token))
            h["x-inference-time"] = _ms(self.end_time - self.arrival - max(0.0, ttft - per_token))
        return h


def finite(logprob: float | None) -> float | None:
    """JSON has no NaN or Infinity: a non-finite logprob (degenerate logits) is reported as null."""
    return logprob if logprob is not None and math.isfinite(logprob) else None


def _ms(seconds: float) -> str:
    return str(int(round(seconds * 1000)))


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


# choices
async def start_all(gens: list[Generation]) -> None:
    """Start every generation; if any fails, close them all and raise the first error."""
    results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(gens)
        raise errors[0]


async def close_all(gens: list[Generation]) -> None:
    for g in gens:
        await g.close()


async def merged_events(gens: list[Generation]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) from every generation, in arrival order."""
    if len(gens) == 1:
        async for ev in gens[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for ev in gen.events():
                queue.put_nowait((i, ev))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_to_end(
    request: Request, gens: list[Generation], on_event: Callable[[int, TokenEvent], None] | None = None
) -> None:
    """The non-streaming wait: start every generation, run each to its end (all aborted if the client goes
    away), always close them, then raise the first failure as its status code. `on_event` sees (choice index,
    event) as they arrive."""
    try:
        await start_all(gens)
        async with abort_on_disconnect(request, gens):
            await asyncio.gather(*(_run(i, g, on_event) for i, g in enumerate(gens)))
    finally:
        await close_all(gens)
    for g in gens:
        g.raise_if_failed()


async def _run(index: int, gen: Generation, on_event: Callable[[int, TokenEvent], None] | None) -> None:
    async for ev in gen.events():
        if on_event is not None:
            on_event(index, ev)


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
