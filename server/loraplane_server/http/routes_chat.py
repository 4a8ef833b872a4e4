"""OpenAI POST /v1/chat/completions: the tokenizer's chat template, n choices, streaming or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplane_server.http.adapter_routing import openai_adapter
from loraplane_server.http.choices import close_all, start_all
from loraplane_server.http.disconnect import abort_on_disconnect
from loraplane_server.http.errors import ApiError
from loraplane_server.http.generation import Generation, TokenEvent
from loraplane_server.http.openai_common import (
    check_unsupported,
    created,
    finish_reason,
    headers,
    make_generations,
    response_id,
    sse_stream,
    token_strings,
    usage,
)
from loraplane_server.http.prompting import chat_prompt_ids, check_budget
from loraplane_server.http.protocol_openai import ChatCompletionRequest
from loraplane_server.http.sampling import unsupported
from loraplane_server.http.sse import SSEResponse
from loraplane_server.http.state import ServerState, get_state

router = APIRouter(tags=["openai"])
_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


@router.post("/v1/chat/completions", responses=_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    _check(body)
    if body.n > state.config.max_choices:
        raise ApiError(422, f"n={body.n} is more than the {state.config.max_choices} choices allowed", param="n")
    adapter_id = openai_adapter(state, body.model)
    messages = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {}) for m in body.messages]
    ids = await asyncio.to_thread(chat_prompt_ids, state, messages)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_new = check_budget(state, ids, body.max_completion_tokens or body.max_tokens, param)
    gens = make_generations(state, "openai", body, [ids], [max_new], body.logprobs, arrival, adapter_id)
    rid, ts = response_id("chatcmpl"), created()
    await start_all(gens)
    if body.stream:
        return SSEResponse(_stream(state, body, gens, rid, ts), headers=headers(gens, rid))
    try:
        async with abort_on_disconnect(request, gens):
            await asyncio.gather(*(g.run() for g in gens))
    finally:
        await close_all(gens)
    for g in gens:
        g.raise_if_failed()
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": g.text},
            "logprobs": _logprobs(state, g.token_ids, g.logprobs) if body.logprobs else None,
            "finish_reason": finish_reason(g),
        }
        for i, g in enumerate(gens)
    ]
    data = {
        "id": rid,
        "object": "chat.completion",
        "created": ts,
        "model": body.model,
        "choices": choices,
        "usage": usage(gens, body.n),
    }
    return JSONResponse(data, headers=headers(gens, rid))


def _check(body: ChatCompletionRequest) -> None:
    check_unsupported(body)
    if body.response_format not in (None, {"type": "text"}):
        raise unsupported("response_format", "structured output (response_format other than text)")
    if body.tools:
        raise unsupported("tools", "tool calling")
    if body.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling")


def _logprobs(state: ServerState, token_ids: list[int], logprobs: list[float | None]) -> dict:
    tokens = token_strings(state, token_ids)
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    }


def _stream(
    state: ServerState, body: ChatCompletionRequest, gens: list[Generation], rid: str, ts: int
) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": ts, "model": body.model}
    head = [
        {
            **base,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        for i in range(len(gens))
    ]

    def chunk(i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.finished and not body.logprobs:
            return None
        logprobs = None
        if body.logprobs and ev.token_id is not None:
            logprobs = _logprobs(state, [ev.token_id], [ev.logprob])
        delta = {"content": ev.text} if ev.text or not ev.finished else {}
        fr = finish_reason(gens[i]) if ev.finished else None
        return {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": fr}]}

    def tail() -> list[dict]:
        if body.stream_options and body.stream_options.include_usage:
            return [{**base, "choices": [], "usage": usage(gens, body.n)}]
        return []

    return sse_stream("/v1/chat/completions", gens, head, chunk, tail)
