"""LoRAX / TGI: POST /generate, POST /generate_stream (SSE), and POST / (either, by `stream`); their request and
response bodies; and which adapter a request names (adapter_id + adapter_source).

LoRAX's adapter_source may be one of its kinds (hub, s3, local), with the location in adapter_id, or a
source URI, with the adapter's name in adapter_id. Either way the source must pass the allowlist, and
an id that already names another source is a 409: a request never re-points someone else's adapter.

With an admin token set, only admins (or anyone under --allow-anonymous-adapter-load) may register a
new adapter this way; others may name an adapter that is already registered, with or without its
source. Errors for callers who are not admins never show sources, the allowlist or server paths.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.sampling_params import MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY
from loraplane_server.serving.http.admin import (
    can_load_adapters,
    check_adapter_id,
    check_source,
    is_admin,
    is_valid_adapter_id,
    unauthorized,
)
from loraplane_server.serving.http.errors import ApiError
from loraplane_server.serving.http.generation import Generation, SSEResponse, TokenEvent, finite, run_to_end, sse
from loraplane_server.serving.http.openai_protocol import (
    REPETITION_PENALTY_DOC,
    SPECULATIVE_DOC,
    TEMPERATURE_DOC,
    TOP_P_DOC,
)
from loraplane_server.serving.http.sampling import (
    ValidText,
    check_budget,
    check_honoured,
    compile_ahead,
    decode,
    encode,
    make_params,
    only,
    sampling_seed,
    truncated,
)
from loraplane_server.serving.http.state import ServerState, get_state
from loraplane_server.serving.http.structured_output import LoraxResponseFormat, from_lorax
from loraplane_server.store.sources import AdapterSourceError, parse_source

# bodies
MAX_STOP = 16


class LoraxParameters(BaseModel):
    """LoRAX's parameters (lorax-client's Parameters, every field of it): an unknown one is a 400 naming it, and
    one this server does not honour is refused by name at any value but those that change nothing."""

    model_config = ConfigDict(extra="forbid")

    adapter_id: str | None = Field(default=None, max_length=1024, description="adapter to apply; none: the base model")
    adapter_source: str | None = Field(
        default=None,
        max_length=2048,
        description="register adapter_id on the fly: hub | local | s3 (LoRAX kinds) or a source URI; "
        "subject to the server's allowlist",
    )
    api_token: str | None = only(
        None, what="a per-request hub token (the server reads adapters with its own credentials, e.g. HF_TOKEN)"
    )
    merged_adapters: dict | None = only(None, what="merging adapters")
    do_sample: bool = False
    max_new_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    ignore_eos_token: bool = False
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=10.0, description=REPETITION_PENALTY_DOC
    )
    return_full_text: bool = False
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description=TEMPERATURE_DOC)
    top_k: int | None = Field(default=None, ge=0, le=1 << 20)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description=TOP_P_DOC)
    truncate: int | None = Field(default=None, ge=1, le=1 << 20)
    typical_p: float | None = only(None, 1.0, what="typical sampling")
    best_of: int | None = Field(default=None, ge=1, le=1, description="only 1 is supported")
    watermark: bool = only(False, what="watermarking")
    speculative: Literal["off", "ngram", "draft"] | None = Field(default=None, description=SPECULATIVE_DOC)
    details: bool = False
    decoder_input_details: bool = False
    return_k_alternatives: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="each generated token's this many most likely tokens (details.tokens[].alternative_tokens)",
    )
    response_format: LoraxResponseFormat | None = Field(
        default=None, description="{type: json_object, schema}: the output is JSON (following the schema if given)"
    )


class GenerateRequest(ValidText):
    """Every string, in parameters too, must be valid Unicode (a lone surrogate is a 400 naming the field); an
    unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1)
    parameters: LoraxParameters = Field(default_factory=lambda: LoraxParameters())
    stream: bool = False


class AlternativeToken(BaseModel):
    id: int
    text: str
    logprob: float


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool
    alternative_tokens: list[AlternativeToken] | None = None


class InputToken(BaseModel):
    id: int
    text: str
    logprob: float | None = None


FinishReason = Literal["length", "eos_token", "stop_sequence"]


class Details(BaseModel):
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken] = Field(default_factory=list)
    tokens: list[Token] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    seed: int | None = None


class StreamResponse(BaseModel):
    token: Token
    generated_text: str | None = None
    details: StreamDetails | None = None


# routes
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
    check_honoured(p, "parameters.")
    structured = from_lorax(p.response_format)
    adapter_id = await lorax_adapter(state, request, p.adapter_id, p.adapter_source)
    ids = await asyncio.to_thread(encode, state, body.inputs)  # with the tokenizer's special tokens, as TGI
    ids = truncated(ids, p.truncate, "left")  # TGI keeps the end of the prompt
    if p.max_new_tokens is None:
        prompt, max_new = check_budget(state, ids, None, "parameters.max_new_tokens")
        max_new = min(max_new, DEFAULT_MAX_NEW_TOKENS)
    else:
        prompt, max_new = check_budget(state, ids, p.max_new_tokens, "parameters.max_new_tokens")
    await compile_ahead(state, structured, "parameters.response_format")
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
        top_logprobs=p.return_k_alternatives or 0,
        prompt_logprobs=0 if p.details and p.decoder_input_details else None,
        speculative=p.speculative,
        structured=structured,
    )
    return Generation(state, "lorax", prompt, params, adapter_id, arrival), seed


def _finish_reason(gen: Generation) -> str:
    if gen.finish_reason == "length":
        return "length"
    return "eos_token" if gen.is_eos else "stop_sequence"


def _token(state: ServerState, ev: TokenEvent) -> dict:
    # a special token that carries text (held back until the end) is reported as text, so none is lost
    token: dict[str, Any] = {
        "id": ev.token_id,
        "text": ev.text,
        "logprob": ev.logprob,
        "special": ev.special and not ev.text,
    }
    if ev.top is not None:
        token["alternative_tokens"] = [{"id": t, "text": decode(state, [t]), "logprob": lp} for t, lp in ev.top]
    return token


async def _generate(state: ServerState, body: GenerateRequest, request: Request) -> tuple[dict, dict[str, str]]:
    gen, seed = await _prepare(state, body, request)
    tokens = []

    def keep(_: int, ev: TokenEvent) -> None:
        if ev.token_id is not None:
            tokens.append(_token(state, ev))

    await run_to_end(request, [gen], keep)
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
    """LoRAX's decoder input details: each prompt token with its logprob given those before it (none for the
    first)."""
    logprobs = [None, *(finite(lp) for _, lp, _, _ in gen.prompt_logprobs or [])]
    return [
        {"id": i, "text": decode(state, [i]), "logprob": logprobs[k] if k < len(logprobs) else None}
        for k, i in enumerate(gen.prompt_ids)
    ]


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
            data: dict = {"token": _token(gen.state, ev), "generated_text": None, "details": None}
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


# adapters
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w.-]+)?$")
_LORAX_KINDS = ("hub", "s3", "local")


async def lorax_adapter(
    state: ServerState,
    request: Request,
    adapter_id: str | None,
    adapter_source: str | None,
    param: str = "parameters.adapter_id",
) -> str | None:
    if not adapter_id or adapter_id == state.config.model_name:
        if adapter_source:
            raise ApiError(422, "adapter_source needs an adapter_id", param="parameters.adapter_source")
        return None
    if adapter_source is None:
        if is_valid_adapter_id(adapter_id):
            return adapter_id
        if ".." not in adapter_id and _HF_REPO.match(adapter_id):
            adapter_source = "hub"  # LoRAX's default: an org/repo on the Hugging Face hub
        else:
            return check_adapter_id(adapter_id, param)
    name, uri = _name_and_uri(adapter_id, adapter_source)
    name = check_adapter_id(name, param)
    if can_load_adapters(request):
        await register(state, name, uri, "parameters.adapter_source", is_admin(request))
    else:
        await require_registered(state, name, uri)
    return name


def _name_and_uri(adapter_id: str, source: str) -> tuple[str, str]:
    if source == "pbase":
        raise ApiError(
            422,
            "adapter_source 'pbase' is not supported; use hub, s3, local or a source URI",
            param="parameters.adapter_source",
            code="unsupported_parameter",
        )
    if source not in _LORAX_KINDS:
        return adapter_id, source  # a URI; adapter_id is the name
    if ".." in adapter_id:
        raise ApiError(
            400, "adapter_id must not contain '..'", param="parameters.adapter_id", code="invalid_adapter_id"
        )
    if source == "hub":
        uri = f"hf://{adapter_id}"
    elif source == "s3":
        uri = adapter_id if adapter_id.startswith("s3://") else f"s3://{adapter_id}"
    else:
        uri = adapter_id
    name = adapter_id.split("://", 1)[-1].strip("/").replace("/", "--").replace("@", "--")
    return re.sub(r"[^A-Za-z0-9._-]", "-", name), uri


async def require_registered(state: ServerState, adapter_id: str, uri: str) -> None:
    """For callers who may not register: the id must already name this very source, else 401."""
    try:
        wanted = parse_source(uri).uri
    except AdapterSourceError:
        wanted = None  # cannot name a registered source
    engine, _ = state.require_engine()

    def _current() -> str | None:
        return engine.adapters.source_of(adapter_id)

    if wanted is None or await state.call(_current) != wanted:
        raise unauthorized(
            f"adapter {adapter_id!r} is not registered on this server with that source, and registering or "
            "loading a new adapter needs the admin token (Authorization: Bearer <token>); ask an admin to "
            "register it (POST /v1/adapters), then name it by its id alone",
            param="parameters.adapter_source",
        )


async def register(state: ServerState, adapter_id: str, uri: str, param: str, admin: bool = True) -> None:
    """Register adapter_id -> uri unless it is already registered with that very source."""
    try:
        source = check_source(uri, state.config.allowlist, param)
    except ApiError as exc:
        if admin or exc.code != "source_not_allowed":
            raise
        raise ApiError(
            403,
            "this adapter source is not allowed on this server; an admin can see the allowed sources "
            "(--adapter-source-allow)",
            param=param,
            code="source_not_allowed",
        ) from None
    engine, _ = state.require_engine()

    def _register() -> str | None:
        known = engine.adapters.source_of(adapter_id)
        if known is None:
            engine.adapters.register(adapter_id, source.uri)
            return None
        return None if known == source.uri else known

    other = await state.call(_register)
    if other is not None:
        raise ApiError(
            409,
            f"adapter {adapter_id!r} is already registered with another source; use its id alone, or another id",
            param=param,
            code="adapter_conflict",
        )
