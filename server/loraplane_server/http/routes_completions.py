"""OpenAI POST /v1/completions: text or token-id prompts (or a batch), n choices, streaming or not."""

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
from loraplane_server.http.prompting import check_budget, check_token_ids, decode, encode
from loraplane_server.http.protocol_openai import CompletionRequest
from loraplane_server.http.sampling import unsupported
from loraplane_server.http.sse import SSEResponse
from loraplane_server.http.state import ServerState, get_state

router = APIRouter(tags=["openai"])
_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


@router.post("/v1/completions", responses=_DOC)
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    check_unsupported(body)
    if body.suffix:
        raise unsupported("suffix", "suffix (insertion)")
    adapter_id = openai_adapter(state, body.model)
    texts, prompts = await asyncio.to_thread(_prompts, state, body)
    if len(prompts) * body.n > state.config.max_choices:
        raise ApiError(
            422,
            f"{len(prompts)} prompts x n={body.n} is more than the {state.config.max_choices} "
            "choices allowed in one request",
            param="n",
        )
    max_new = [check_budget(state, ids, body.max_tokens, "max_tokens") for ids in prompts]
    gens = make_generations(state, "openai", body, prompts, max_new, body.logprobs is not None, arrival, adapter_id)
    rid, ts = response_id("cmpl"), created()
    await start_all(gens)
    if body.stream:
        return SSEResponse(_stream(state, body, gens, texts, rid, ts), headers=headers(gens, rid))
    try:
        async with abort_on_disconnect(request, gens):
            await asyncio.gather(*(g.run() for g in gens))
    finally:
        await close_all(gens)
    for g in gens:
        g.raise_if_failed()
    choices = [_choice(state, body, i, g, texts[i // body.n]) for i, g in enumerate(gens)]
    data = {
        "id": rid,
        "object": "text_completion",
        "created": ts,
        "model": body.model,
        "choices": choices,
        "usage": usage(gens, body.n),
    }
    return JSONResponse(data, headers=headers(gens, rid))


def _prompts(state: ServerState, body: CompletionRequest) -> tuple[list[str], list[list[int]]]:
    """(prompt texts for echo, prompt token ids)."""
    p = body.prompt
    if isinstance(p, str):
        return [p], [encode(state, p)]
    if not p:
        raise ApiError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    ints = [x for x in p if isinstance(x, int)]
    if len(ints) == len(p):
        return [decode(state, check_token_ids(state, ints, "prompt"))], [ints]
    texts = [x for x in p if isinstance(x, str)]
    if len(texts) == len(p):
        return texts, [encode(state, x) for x in texts]
    batch = [check_token_ids(state, x, "prompt") for x in p if isinstance(x, list)]
    return [decode(state, x) for x in batch], batch


def _logprobs(state: ServerState, gen: Generation, offset: int) -> dict:
    tokens = token_strings(state, gen.token_ids)
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": gen.logprobs, "top_logprobs": None, "text_offset": offsets}


def _choice(state: ServerState, body: CompletionRequest, index: int, gen: Generation, prompt_text: str) -> dict:
    prefix = prompt_text if body.echo else ""
    logprobs = _logprobs(state, gen, len(prefix)) if body.logprobs is not None else None
    return {"index": index, "text": prefix + gen.text, "logprobs": logprobs, "finish_reason": finish_reason(gen)}


def _stream(
    state: ServerState, body: CompletionRequest, gens: list[Generation], texts: list[str], rid: str, ts: int
) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "text_completion", "created": ts, "model": body.model}

    def chunk(i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.finished and body.logprobs is None:
            return None
        logprobs = None
        if body.logprobs is not None and ev.token_id is not None:
            logprobs = {
                "tokens": token_strings(state, [ev.token_id]),
                "token_logprobs": [ev.logprob],
                "top_logprobs": None,
                "text_offset": [0],
            }
        fr = finish_reason(gens[i]) if ev.finished else None
        return {**base, "choices": [{"index": i, "text": ev.text, "logprobs": logprobs, "finish_reason": fr}]}

    head = []
    if body.echo:
        head = [
            {**base, "choices": [{"index": i, "text": texts[i // body.n], "logprobs": None, "finish_reason": None}]}
            for i in range(len(gens))
        ]

    def tail() -> list[dict]:
        if body.stream_options and body.stream_options.include_usage:
            return [{**base, "choices": [], "usage": usage(gens, body.n)}]
        return []

    return sse_stream("/v1/completions", gens, head, chunk, tail)
