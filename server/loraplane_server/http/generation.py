"""One request's trip through the engine: admission, first token, token events, timing, metrics.

Every route builds a Generation, awaits start() (errors before the first token become status codes),
iterates events() and always calls close(): closing the engine stream aborts an unfinished request
at once (its KV blocks are freed) and the request is counted in the metrics exactly once.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loraplane_server.engine import RequestOutput
from loraplane_server.errors import EngineError, RequestFailedError
from loraplane_server.http.errors import ApiError, api_error, rejected_error
from loraplane_server.http.lifecycle import Rejected
from loraplane_server.http.state import ServerState
from loraplane_server.http.text_delta import TextDelta
from loraplane_server.sampling_params import SamplingParams


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


class Generation:
    def __init__(
        self,
        state: ServerState,
        api: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        arrival: float | None = None,
    ) -> None:
        self.state = state
        self.api = api
        self.request_id = f"{api}-{uuid.uuid4().hex}"
        self.prompt_ids = prompt_ids
        self.params = params
        self.adapter_id = adapter_id
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.delta = TextDelta(params.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.text = ""
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
        self._stream = front.generate(self.prompt_ids, self.params, self.request_id, self.adapter_id)
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

    async def run(self) -> None:
        """Consume every event (the non-streaming routes)."""
        async for _ in self.events():
            pass

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

    def _event(self, out: RequestOutput) -> TokenEvent:
        now = time.monotonic()
        token = out.new_token_ids[-1] if out.new_token_ids else None
        logprob = None
        if token is not None:
            self.token_ids.append(token)
            if self.params.logprobs and out.logprobs:
                logprob = _finite(out.logprobs[-1])
            self.logprobs.append(logprob)
            if self._last_token_time is not None:
                self.state.metrics.itl.observe(now - self._last_token_time)
            self._last_token_time = now
            self.first_token_time = self.first_token_time or now
        piece = self.delta.push(out.text, out.finished)
        self.text += piece
        if out.finished:
            self.finish_reason, self.error, self.failure = out.finish_reason, out.error, out.failure
            self.end_time = now
        special = token is not None and token in self.state.special_ids
        return TokenEvent(token, piece, logprob, special, out.finished, out.finish_reason, out.error)

    # reporting
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


def _finite(logprob: float | None) -> float | None:
    """JSON has no NaN or Infinity: a non-finite logprob (degenerate logits) is reported as null."""
    return logprob if logprob is not None and math.isfinite(logprob) else None


def _ms(seconds: float) -> str:
    return str(int(round(seconds * 1000)))
