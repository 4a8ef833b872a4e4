"""OpenAI's API: POST /v1/completions (text or token-id prompts, or a batch) and POST /v1/chat/completions
(the tokenizer's chat template), n choices each, streaming or not. Request bodies: openai_protocol.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplane_server.engine.input_processor import CheckedPrompt
from loraplane_server.serving.http.admin import check_adapter_id
from loraplane_server.serving.http.errors import ApiError, error_body
from loraplane_server.serving.http.generation import (
    Generation,
    SSEResponse,
    TokenEvent,
    close_all,
    merged_events,
    run_to_end,
    sse,
    start_all,
)
from loraplane_server.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from loraplane_server.serving.http.sampling import (
    chat_prompt_ids,
    check_budget,
    check_token_ids,
    decode,
    encode,
    make_params,
    sampling_seed,
    unsupported,
)
from loraplane_server.serving.http.state import ServerState, get_state

router = APIRouter(tags=["openai"])
_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


# completions
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
    checked = [check_budget(state, ids, body.max_tokens, "max_tokens") for ids in prompts]
    gens = make_generations(state, "openai", body, checked, body.logprobs is not None, arrival, adapter_id)
    rid, ts = response_id("cmpl"), created()
    if body.stream:
        await start_all(gens)
        return SSEResponse(_completion_stream(state, body, gens, texts, rid, ts), headers=headers(gens, rid))

    def choice(i: int, g: Generation) -> dict:
        return _completion_choice(state, body, i, g, texts[i // body.n])

    return await respond(request, body, gens, rid, ts, "text_completion", choice)


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


def _completion_logprobs(state: ServerState, gen: Generation, offset: int) -> dict:
    tokens = token_strings(state, gen.token_ids)
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": gen.logprobs, "top_logprobs": None, "text_offset": offsets}


def _completion_choice(
    state: ServerState, body: CompletionRequest, index: int, gen: Generation, prompt_text: str
) -> dict:
    prefix = prompt_text if body.echo else ""
    logprobs = _completion_logprobs(state, gen, len(prefix)) if body.logprobs is not None else None
    return {"index": index, "text": prefix + gen.text, "logprobs": logprobs, "finish_reason": finish_reason(gen)}


def _completion_stream(
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


# chat
@router.post("/v1/chat/completions", responses=_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    _check_chat(body)
    if body.n > state.config.max_choices:
        raise ApiError(422, f"n={body.n} is more than the {state.config.max_choices} choices allowed", param="n")
    adapter_id = openai_adapter(state, body.model)
    messages = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {}) for m in body.messages]
    ids = await asyncio.to_thread(chat_prompt_ids, state, messages)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    checked = check_budget(state, ids, body.max_completion_tokens or body.max_tokens, param)
    gens = make_generations(state, "openai", body, [checked], body.logprobs, arrival, adapter_id)
    rid, ts = response_id("chatcmpl"), created()
    if body.stream:
        await start_all(gens)
        return SSEResponse(_chat_stream(state, body, gens, rid, ts), headers=headers(gens, rid))

    def choice(i: int, g: Generation) -> dict:
        return {
            "index": i,
            "message": {"role": "assistant", "content": g.text},
            "logprobs": _chat_logprobs(state, g.token_ids, g.logprobs) if body.logprobs else None,
            "finish_reason": finish_reason(g),
        }

    return await respond(request, body, gens, rid, ts, "chat.completion", choice)


def _check_chat(body: ChatCompletionRequest) -> None:
    check_unsupported(body)
    if body.response_format not in (None, {"type": "text"}):
        raise unsupported("response_format", "structured output (response_format other than text)")
    if body.tools:
        raise unsupported("tools", "tool calling")
    if body.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling")


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list[float | None]) -> dict:
    tokens = token_strings(state, token_ids)
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    }


def _chat_stream(
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
            logprobs = _chat_logprobs(state, [ev.token_id], [ev.logprob])
        delta = {"content": ev.text} if ev.text or not ev.finished else {}
        fr = finish_reason(gens[i]) if ev.finished else None
        return {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": fr}]}

    def tail() -> list[dict]:
        if body.stream_options and body.stream_options.include_usage:
            return [{**base, "choices": [], "usage": usage(gens, body.n)}]
        return []

    return sse_stream("/v1/chat/completions", gens, head, chunk, tail)


# shared
_NAMES = {"max_new_tokens": "max_tokens"}


def openai_adapter(state: ServerState, model: str) -> str | None:
    """None for the base model (its own name), else the adapter id (400 if it cannot be one)."""
    if model == state.config.model_name:
        return None
    return check_adapter_id(model, "model")


def check_unsupported(body: SamplingFields) -> None:
    if body.presence_penalty:
        raise unsupported("presence_penalty", "a non-zero presence_penalty (use repetition_penalty)")
    if body.frequency_penalty:
        raise unsupported("frequency_penalty", "a non-zero frequency_penalty (use repetition_penalty)")
    if body.logit_bias:
        raise unsupported("logit_bias", "logit_bias")


def make_generations(
    state: ServerState,
    api: str,
    body: SamplingFields,
    prompts: list[tuple[CheckedPrompt, int]],
    logprobs: bool,
    arrival: float,
    adapter_id: str | None,
) -> list[Generation]:
    """body.n generations per prompt; choice i*n + j is prompt i's j-th sample (seed + j when seeded)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    gens = []
    for prompt, limit in prompts:
        for j in range(body.n):
            seed = sampling_seed(None if body.seed is None else (body.seed + j) % (1 << 63), temperature > 0)
            params = make_params(
                _NAMES,
                max_new_tokens=limit,
                temperature=temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(0, body.top_k or 0),
                repetition_penalty=body.repetition_penalty or 1.0,
                seed=seed,
                stop=body.stop_list(),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                speculative=body.speculative,
            )
            gens.append(Generation(state, api, prompt, params, adapter_id, arrival))
    return gens


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())


def finish_reason(gen: Generation) -> str | None:
    return {"stop": "stop", "length": "length"}.get(gen.finish_reason or "", gen.finish_reason)


def usage(gens: list[Generation], n: int) -> dict:
    # a prompt shared by n choices is counted once, as OpenAI does
    prompt = sum(len(gens[i].prompt_ids) for i in range(0, len(gens), n))
    completion = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_strings(state: ServerState, token_ids: list[int]) -> list[str]:
    return [decode(state, [t]) for t in token_ids]


def headers(gens: list[Generation], rid: str) -> dict[str, str]:
    return {**gens[0].headers(), "x-request-id": rid}


async def sse_stream(
    path: str,
    gens: list[Generation],
    head: list[dict],
    chunk: Callable[[int, TokenEvent], dict | None],
    tail: Callable[[], list[dict]],
) -> AsyncIterator[bytes]:
    """head chunks, one chunk per event worth sending, tail chunks, then [DONE]; always closes the generations."""
    try:
        for first in head:
            yield sse(first)
        async for i, ev in merged_events(gens):
            if ev.token_id is None and ev.finish_reason in ("error", "abort"):
                yield sse(error_body(path, 500, f"choice {i}: {ev.error or 'the request was aborted'}"))
                continue
            c = chunk(i, ev)
            if c is not None:
                yield sse(c)
        for last in tail():
            yield sse(last)
        yield sse("[DONE]")
    finally:
        await close_all(gens)


async def respond(
    request: Request,
    body: SamplingFields,
    gens: list[Generation],
    rid: str,
    ts: int,
    kind: str,
    choice: Callable[[int, Generation], dict],
) -> JSONResponse:
    """The non-streaming answer: every choice run to its end, then {id, object, created, model, choices, usage}."""
    await run_to_end(request, gens)
    data = {
        "id": rid,
        "object": kind,
        "created": ts,
        "model": body.model,
        "choices": [choice(i, g) for i, g in enumerate(gens)],
        "usage": usage(gens, body.n),
    }
    return JSONResponse(data, headers=headers(gens, rid))
