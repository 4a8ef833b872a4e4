"""LoRAX / TGI routes: POST /generate, POST /generate_stream (SSE), and POST / (either, by `stream`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplane_server.http.adapter_routing import lorax_adapter
from loraplane_server.http.disconnect import abort_on_disconnect
from loraplane_server.http.generation import Generation, TokenEvent
from loraplane_server.http.prompting import check_budget, decode, encode
from loraplane_server.http.protocol_lorax import GenerateRequest, GenerateResponse
from loraplane_server.http.sampling import make_params, sampling_seed, unsupported
from loraplane_server.http.sse import SSEResponse, sse
from loraplane_server.http.state import ServerState, get_state

DEFAULT_MAX_NEW_TOKENS = 20
_NAMES = {
    "max_new_tokens": "parameters.max_new_tokens",
    "temperature": "parameters.temperature",
    "top_k": "parameters.top_k",
    "top_p": "parameters.top_p",
    "stop": "parameters.stop",
    "repetition_penalty": "parameters.repetition_penalty",
}
_SSE_DOC: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "server-sent events, one per token"}
}

router = APIRouter(tags=["lorax"])


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> Response:
    data, headers = await _generate(get_state(request), body, request)
    return JSONResponse(data, headers=headers)


@router.post("/generate_stream", responses=_SSE_DOC)
async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    return await _stream(get_state(request), body, request)


@router.post("/", response_model=list[GenerateResponse], responses=_SSE_DOC)
async def compat_generate(body: GenerateRequest, request: Request) -> Response:
    """TGI's compatibility route (what lorax-client posts to): a one-element list, or SSE if `stream`."""
    state = get_state(request)
    if body.stream:
        return await _stream(state, body, request)
    data, headers = await _generate(state, body, request)
    return JSONResponse([data], headers=headers)


async def _prepare(state: ServerState, body: GenerateRequest, request: Request) -> tuple[Generation, int | None]:
    arrival = time.monotonic()
    p = body.parameters
    if p.merged_adapters is not None:
        raise unsupported("parameters.merged_adapters", "merging adapters")
    if p.response_format is not None:
        raise unsupported("parameters.response_format", "structured output")
    if p.watermark:
        raise unsupported("parameters.watermark", "watermarking")
    if p.typical_p not in (None, 1.0):
        raise unsupported("parameters.typical_p", "typical sampling")
    adapter_id = await lorax_adapter(state, request, p.adapter_id, p.adapter_source)
    ids = await asyncio.to_thread(encode, state, body.inputs)
    if p.truncate is not None:
        ids = ids[-p.truncate :]
    if p.max_new_tokens is None:
        max_new = check_budget(state, ids, None, "parameters.max_new_tokens")
        max_new = min(max_new, DEFAULT_MAX_NEW_TOKENS)
    else:
        max_new = check_budget(state, ids, p.max_new_tokens, "parameters.max_new_tokens")
    # TGI: any warper (temperature != 1, top_k, top_p < 1) turns sampling on, temperature 0 turns it off
    warpers = p.temperature not in (None, 1.0) or bool(p.top_k) or p.top_p not in (None, 1.0)
    sampling = (p.do_sample or warpers) and p.temperature != 0.0
    seed = sampling_seed(p.seed, sampling)
    params = make_params(
        _NAMES,
        max_new_tokens=max_new,
        temperature=(p.temperature or 1.0) if sampling else 0.0,
        top_k=p.top_k or 0,
        top_p=p.top_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        seed=seed,
        stop=list(p.stop),
        ignore_eos=p.ignore_eos_token,
        logprobs=True,
    )
    return Generation(state, "lorax", ids, params, adapter_id, arrival), seed


def _finish_reason(gen: Generation) -> str:
    if gen.finish_reason == "length":
        return "length"
    return "eos_token" if gen.is_eos else "stop_sequence"


def _token(ev: TokenEvent) -> dict:
    # a special token that carries text (held back until the end) is reported as text, so none is lost
    return {"id": ev.token_id, "text": ev.text, "logprob": ev.logprob, "special": ev.special and not ev.text}


async def _generate(state: ServerState, body: GenerateRequest, request: Request) -> tuple[dict, dict[str, str]]:
    gen, seed = await _prepare(state, body, request)
    tokens = []
    try:
        await gen.start()
        async with abort_on_disconnect(request, [gen]):
            async for ev in gen.events():
                if ev.token_id is not None:
                    tokens.append(_token(ev))
    finally:
        await gen.close()
    gen.raise_if_failed()
    text = body.inputs + gen.text if body.parameters.return_full_text else gen.text
    data: dict = {"generated_text": text}
    if body.parameters.details:
        prefill = await asyncio.to_thread(_prefill, state, gen) if body.parameters.decoder_input_details else []
        data["details"] = {
            "finish_reason": _finish_reason(gen),
            "prompt_tokens": len(gen.prompt_ids),
            "generated_tokens": len(gen.token_ids),
            "seed": seed,
            "prefill": prefill,
            "tokens": tokens,
        }
    return data, gen.headers()


def _prefill(state: ServerState, gen: Generation) -> list[dict]:
    return [{"id": i, "text": decode(state, [i]), "logprob": None} for i in gen.prompt_ids]


async def _stream(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    gen, seed = await _prepare(state, body, request)
    try:
        await gen.start()
    except BaseException:
        await gen.close()
        raise
    return SSEResponse(_events(gen, body, seed), headers=gen.headers())


async def _events(gen: Generation, body: GenerateRequest, seed: int | None) -> AsyncIterator[bytes]:
    try:
        async for ev in gen.events():
            if ev.token_id is None:
                if ev.finish_reason in ("error", "abort"):
                    yield sse({"error": ev.error or "the request was aborted", "error_type": "generation"})
                return
            data: dict = {"token": _token(ev), "generated_text": None, "details": None}
            if ev.finished:
                full = body.inputs + gen.text if body.parameters.return_full_text else gen.text
                data["generated_text"] = full
                data["details"] = {
                    "finish_reason": _finish_reason(gen),
                    "prompt_tokens": len(gen.prompt_ids),
                    "generated_tokens": len(gen.token_ids),
                    "seed": seed,
                }
            yield sse(data)
    finally:
        await gen.close()
