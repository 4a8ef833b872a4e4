"""OpenAI's API: POST /v1/completions (text or token-id prompts, or a batch) and POST /v1/chat/completions
(the tokenizer's chat template), n choices each, streaming or not, free or constrained (structured output).
Request bodies: openai_protocol.py; every field there is honoured or refused by name (check_request)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplane_server.engine.input_processor import CheckedPrompt
from loraplane_server.sampling_params import SamplingParams, StructuredOutput
from loraplane_server.serving.http.admin import check_adapter_id
from loraplane_server.serving.http.errors import ApiError, error_body
from loraplane_server.serving.http.generation import (
    Generation,
    SSEResponse,
    TokenEvent,
    close_all,
    finite,
    merged_events,
    run_to_end,
    sse,
    start_all,
)
from loraplane_server.serving.http.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from loraplane_server.serving.http.sampling import (
    ChatOptions,
    chat_prompt_ids,
    check_budget,
    check_honoured,
    check_token_ids,
    compile_ahead,
    decode,
    encode,
    make_params,
    sampling_seed,
    template_mentions,
    truncated,
)
from loraplane_server.serving.http.state import ServerState, get_state
from loraplane_server.serving.http.structured_output import (
    from_guided,
    from_response_format,
    from_structured_outputs,
    single,
)
from loraplane_server.serving.http.tools import (
    MARKERS,
    ToolCall,
    ToolPlan,
    ToolStream,
    plan_tools,
    template_tool_calls,
    tool_calls_as_text,
)

router = APIRouter(tags=["openai"])
_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


# completions
@router.post("/v1/completions", responses=_DOC)
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    structured = check_request(body)
    adapter_id = openai_adapter(state, body.model)
    texts, prompts = await asyncio.to_thread(_prompts, state, body)
    prompts = [truncate_prompt(state, body, ids, body.max_tokens) for ids in prompts]
    if len(prompts) * body.n > state.config.max_choices:
        raise ApiError(
            422,
            f"{len(prompts)} prompts x n={body.n} is more than the {state.config.max_choices} "
            "choices allowed in one request",
            param="n",
        )
    if body.stream and body.echo and body.logprobs is not None:
        raise ApiError(
            422,
            "echo with logprobs is answered whole, not streamed: send stream false (or leave out echo or logprobs)",
            param="echo",
            code="unsupported_parameter",
        )
    checked = [check_budget(state, ids, body.max_tokens, "max_tokens") for ids in prompts]
    await compile_ahead(state, structured, constraint_field(body))
    gens = make_generations(
        state, "openai", body, checked, body.logprobs is not None, arrival, adapter_id, structured, body.logprobs or 0
    )
    rid, ts = response_id("cmpl", body.request_id), created()
    if body.stream:
        await start_all(gens)
        return SSEResponse(_completion_stream(state, body, gens, texts, rid, ts), headers=headers(gens, rid))

    def choice(i: int, g: Generation) -> dict:
        return _completion_choice(state, body, i, g, texts[i // body.n])

    return await respond(request, body, gens, rid, ts, "text_completion", choice)


def _prompts(state: ServerState, body: CompletionRequest) -> tuple[list[str], list[list[int]]]:
    """(prompt texts for echo, prompt token ids). Text is encoded with the tokenizer's special tokens unless
    add_special_tokens is false (vLLM's field)."""
    p, special = body.prompt, body.add_special_tokens
    if isinstance(p, str):
        return [p], [encode(state, p, special)]
    if not p:
        raise ApiError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    ints = [x for x in p if isinstance(x, int)]
    if len(ints) == len(p):
        return [decode(state, check_token_ids(state, ints, "prompt"))], [ints]
    texts = [x for x in p if isinstance(x, str)]
    if len(texts) == len(p):
        return texts, [encode(state, x, special) for x in texts]
    batch = [check_token_ids(state, x, "prompt") for x in p if isinstance(x, list)]
    return [decode(state, x) for x in batch], batch


def _completion_logprobs(state: ServerState, gen: Generation, offset: int, echo: bool = False) -> dict:
    """OpenAI's legacy logprobs: the generated tokens, or with echo the prompt's first (its first token has
    none: nothing comes before it), each with its logprob, its alternatives when asked and its text offset."""
    tokens = token_strings(state, gen.token_ids)
    logprobs: list[float | None] = list(gen.logprobs)
    top: list[dict[str, float] | None] | None = None
    if gen.params.top_logprobs:
        top = [_top_dict(state, t) for t in gen.top_logprobs]
    if echo:
        prompt = gen.prompt_logprobs or []
        tokens = token_strings(state, gen.prompt_ids) + tokens
        logprobs = [None, *(finite(lp) for _, lp, _, _ in prompt), *logprobs]
        if top is not None:
            top = [None, *(_top_dict(state, alt) for _, _, _, alt in prompt), *top]
        offset = 0
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_of(state: ServerState, gen: Generation) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token its own entry and its top-k
    alternatives, each {logprob, rank, decoded_token} by token id."""
    if gen.params.prompt_logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, lp, rank, alternatives in gen.prompt_logprobs or []:
        entry = {str(token): {"logprob": finite(lp), "rank": rank, "decoded_token": decode(state, [token])}}
        for r, (alt, alt_lp) in enumerate(alternatives, start=1):
            entry.setdefault(str(alt), {"logprob": finite(alt_lp), "rank": r, "decoded_token": decode(state, [alt])})
        out.append(entry)
    return out


def _top_dict(state: ServerState, top: list[tuple[int, float]]) -> dict[str, float]:
    """A completion position's alternatives as OpenAI's legacy shape: token text -> logprob, best first."""
    return dict(zip(token_strings(state, [t for t, _ in top]), (lp for _, lp in top), strict=True))


def _completion_choice(
    state: ServerState, body: CompletionRequest, index: int, gen: Generation, prompt_text: str
) -> dict:
    prefix = prompt_text if body.echo else ""
    logprobs = _completion_logprobs(state, gen, len(prefix), body.echo) if body.logprobs is not None else None
    choice = {"index": index, "text": prefix + gen.text, "logprobs": logprobs, "finish_reason": finish_reason(gen)}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_of(state, gen)
    return choice


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
                "top_logprobs": None if ev.top is None else [_top_dict(state, ev.top)],
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
    structured = check_request(body)
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    forced = plan.constraint() if plan is not None else None
    if forced is not None and plan is not None:
        if structured is not None:
            raise ApiError(
                400,
                f"tool_choice {plan.mode}: the output is the calls' JSON, so it cannot also follow response_format, "
                "structured_outputs or guided_*",
                param="tool_choice",
                code="conflicting_constraints",
            )
        structured = forced
    if body.n > state.config.max_choices:
        raise ApiError(422, f"n={body.n} is more than the {state.config.max_choices} choices allowed", param="n")
    adapter_id = openai_adapter(state, body.model)
    calls_in_template = template_mentions(state, "tool_calls")
    messages = [_message(m, calls_in_template) for m in body.messages]
    options = ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        template_kwargs=dict(body.chat_template_kwargs or {}),
        tools=plan.template_tools if plan is not None else None,
    )
    ids = await asyncio.to_thread(chat_prompt_ids, state, messages, options)
    max_new = body.max_completion_tokens or body.max_tokens
    ids = truncate_prompt(state, body, ids, max_new)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    checked = check_budget(state, ids, max_new, param)
    await compile_ahead(state, structured, "tools" if forced is not None else constraint_field(body))
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    gens = make_generations(state, "openai", body, [checked], body.logprobs, arrival, adapter_id, structured, top)
    rid, ts = response_id("chatcmpl", body.request_id), created()
    if body.stream:
        await start_all(gens)
        return SSEResponse(_chat_stream(state, body, gens, rid, ts, plan), headers=headers(gens, rid))

    def choice(i: int, g: Generation) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": g.text}
        fr = finish_reason(g)
        if plan is not None and plan.mode != "none" and g.finish_reason in ("stop", "length"):
            content, calls = answer_calls(plan, raw_text(state, g))
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
                fr = "tool_calls" if plan.mode != "named" and g.finish_reason == "stop" else fr
        return {
            "index": i,
            "message": message,
            "logprobs": _chat_logprobs(state, g.token_ids, g.logprobs, g.top_logprobs) if body.logprobs else None,
            "finish_reason": fr,
        }

    def extra() -> dict[str, Any]:  # vLLM's place for a chat's prompt logprobs: the response's top level
        return {"prompt_logprobs": prompt_logprobs_of(state, gens[0])} if body.prompt_logprobs is not None else {}

    return await respond(request, body, gens, rid, ts, "chat.completion", choice, extra)


def _message(m: ChatMessage, calls_in_template: bool = True) -> dict[str, Any]:
    """A message as the chat template reads it; an assistant turn's tool calls as transformers passes them (or,
    for a template that reads none, as Hermes text in its content)."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if calls_in_template:
            message["tool_calls"] = template_tool_calls(calls)
        else:
            message["content"] = "\n".join(x for x in (message["content"], tool_calls_as_text(calls)) if x)
    return message


def answer_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The answer's (content, tool calls); a forced answer cut short (no valid JSON) is its text, no calls."""
    try:
        return plan.calls(text)
    except (ValueError, TypeError, KeyError):
        return text, []


def marker_ids(state: ServerState) -> dict[int, str]:
    """The tool-call markers that are special tokens of this tokenizer (dropped from decoded text): id -> text."""
    engine, _ = state.require_engine()
    tok = engine.tokenizer
    found = {}
    for marker in MARKERS:
        token_id = tok.convert_tokens_to_ids(marker) if tok is not None else None
        if isinstance(token_id, int) and token_id in state.special_ids:
            found[token_id] = marker
    return found


def raw_text(state: ServerState, gen: Generation) -> str:
    """The generated text with any special tool-call marker kept (Mistral's [TOOL_CALLS], Llama's
    <|python_tag|>): what the tool-call parser reads."""
    markers = marker_ids(state)
    if not markers or not any(t in markers for t in gen.token_ids):
        return gen.text
    return "".join(markers.get(t) or decode(state, [t]) for t in gen.token_ids)


def _chat_logprobs(
    state: ServerState,
    token_ids: list[int],
    logprobs: list[float | None],
    top: list[list[tuple[int, float]]] | None = None,
) -> dict:
    """OpenAI's chat logprobs: each token with its logprob, its UTF-8 bytes and its top alternatives."""
    tokens = token_strings(state, token_ids)
    tops = top or [[] for _ in tokens]
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": _top_entries(state, alt)}
            for t, lp, alt in zip(tokens, logprobs, tops, strict=True)
        ]
    }


def _top_entries(state: ServerState, top: list[tuple[int, float]]) -> list[dict]:
    texts = token_strings(state, [t for t, _ in top])
    return [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, (_, lp) in zip(texts, top, strict=True)]


def _chat_stream(
    state: ServerState,
    body: ChatCompletionRequest,
    gens: list[Generation],
    rid: str,
    ts: int,
    plan: ToolPlan | None = None,
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

    tools = _ToolDeltas(state, plan, len(gens)) if plan is not None and plan.mode != "none" else None

    def chunk(i: int, ev: TokenEvent) -> dict | list[dict] | None:
        logprobs = None
        if body.logprobs and ev.token_id is not None:
            logprobs = _chat_logprobs(state, [ev.token_id], [ev.logprob], None if ev.top is None else [ev.top])
        fr = finish_reason(gens[i]) if ev.finished else None
        if tools is not None:
            deltas, fr = tools.deltas(i, ev, gens[i], fr)
            if logprobs is not None and not deltas:
                deltas = [{}]
            out = [
                {**base, "choices": [{"index": i, "delta": d, "logprobs": logprobs if k == 0 else None,
                                      "finish_reason": None}]}
                for k, d in enumerate(deltas)
            ]  # fmt: skip
            if ev.finished:
                out.append({**base, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": fr}]})
            return out
        if not ev.text and not ev.finished and not body.logprobs:
            return None
        delta = {"content": ev.text} if ev.text or not ev.finished else {}
        return {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": fr}]}

    def tail() -> list[dict]:
        if body.stream_options and body.stream_options.include_usage:
            return [{**base, "choices": [], "usage": usage(gens, body.n)}]
        return []

    return sse_stream("/v1/chat/completions", gens, head, chunk, tail)


class _ToolDeltas:
    """A streamed answer's tool calls as OpenAI's deltas (the SDK assembles them by index): a named call's
    arguments as they are generated; a required answer's calls at its end (its JSON is complete only then);
    an auto answer's content as it comes until a call may have begun (ToolStream), its calls at the end."""

    def __init__(self, state: ServerState, plan: ToolPlan, choices: int) -> None:
        self.state, self.plan = state, plan
        self.markers = marker_ids(state)
        self.streams = [ToolStream() for _ in range(choices)]
        self.started = [False] * choices
        self.call_ids = [ToolCall("", "").id for _ in range(choices)]

    def deltas(self, i: int, ev: TokenEvent, gen: Generation, fr: str | None) -> tuple[list[dict], str | None]:
        piece = (self.markers.get(ev.token_id, "") if ev.token_id is not None else "") + ev.text
        plan, out = self.plan, list[dict[str, Any]]()
        if plan.mode == "named":
            if not self.started[i]:
                self.started[i] = True
                head = {"index": 0, "id": self.call_ids[i], "type": "function",
                        "function": {"name": plan.named, "arguments": ""}}  # fmt: skip
                out.append({"tool_calls": [head]})
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out, fr
        stream = self.streams[i]
        content = stream.feed(piece)
        if plan.mode == "auto" and content:
            out.append({"content": content})
        if not ev.finished:
            return out, fr
        if plan.mode == "required":
            tail, calls = answer_calls(plan, stream.text)
            tail = tail if not calls else None
        else:
            tail, calls = stream.calls(plan.names)
            calls = calls[:1] if calls and not plan.parallel else calls
        if tail:
            out.append({"content": tail})
        if calls:
            out.append({"tool_calls": [{"index": k, **c.as_openai()} for k, c in enumerate(calls)]})
            if gen.finish_reason == "stop":
                fr = "tool_calls"
        return out, fr


# shared
_NAMES = {"max_new_tokens": "max_tokens"}


def openai_adapter(state: ServerState, model: str) -> str | None:
    """None for the base model (its own name), else the adapter id (400 if it cannot be one)."""
    if model == state.config.model_name:
        return None
    return check_adapter_id(model, "model")


def check_request(body: SamplingFields) -> StructuredOutput | None:
    """A 422 naming the first field the server would not honour; else the request's one output constraint
    (None: free text), from whichever of response_format, structured_outputs and guided_* names it (two: a 400
    naming both)."""
    check_honoured(body)
    return single(
        from_response_format(body.response_format)
        + from_structured_outputs(body.structured_outputs)
        + from_guided(
            body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar, body.guided_decoding_backend
        )
    )


def constraint_field(body: SamplingFields) -> str:
    """The field that set the request's constraint (check_request allows one), for an error naming it."""
    fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    return next((f for f in fields if getattr(body, f) is not None), "response_format")


def truncate_prompt(state: ServerState, body: SamplingFields, ids: list[int], max_new: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep that many prompt tokens (-1: what the context leaves beside max_new),
    dropping them from truncation_side (none: the tokenizer's own side, as vLLM does)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    engine, _ = state.require_engine()
    if keep == -1:
        keep = max(1, engine.max_model_len - (max_new or 1))
    side = body.truncation_side or getattr(engine.tokenizer, "truncation_side", None) or "left"
    return truncated(ids, keep, side)


def make_generations(
    state: ServerState,
    api: str,
    body: SamplingFields,
    prompts: list[tuple[CheckedPrompt, int]],
    logprobs: bool,
    arrival: float,
    adapter_id: str | None,
    structured: StructuredOutput | None = None,
    top_logprobs: int = 0,
) -> list[Generation]:
    """body.n generations per prompt; choice i*n + j is prompt i's j-th sample (seed + j when seeded)."""
    gens = []
    for prompt, limit in prompts:
        for j in range(body.n):
            params = sampling_params(body, limit, logprobs, j, structured, top_logprobs)
            gens.append(Generation(state, api, prompt, params, adapter_id, arrival))
    return gens


def sampling_params(
    body: SamplingFields,
    max_new: int,
    logprobs: bool,
    choice: int = 0,
    structured: StructuredOutput | None = None,
    top_logprobs: int = 0,
) -> SamplingParams:
    """The engine's SamplingParams for one choice of an OpenAI request (`choice` j is seeded seed + j)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = sampling_seed(None if body.seed is None else (body.seed + choice) % (1 << 63), temperature > 0)
    return make_params(
        _NAMES,
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        repetition_penalty=body.repetition_penalty or 1.0,
        seed=seed,
        stop_token_ids=list(body.stop_token_ids or []),
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs(body),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=logit_bias(body.logit_bias),
        min_p=body.min_p or 0.0,
        speculative=body.speculative,
        structured=structured,
    )


def prompt_logprobs(body: SamplingFields) -> int | None:
    """The alternatives per prompt position the engine computes: vLLM's prompt_logprobs, and for a completion
    that echoes its prompt with logprobs, as many as its generated tokens get (OpenAI's echo shows the prompt's
    logprobs too)."""
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        return max(body.prompt_logprobs or 0, body.logprobs)
    return body.prompt_logprobs


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with int keys; a key that is no token id is a 400."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise ApiError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias")
        out[int(key)] = value
    return out


def response_id(prefix: str, request_id: str | None = None) -> str:
    """The response's id: the client's request_id (vLLM's field) after the prefix, else a fresh one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


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
    chunk: Callable[[int, TokenEvent], dict | list[dict] | None],
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
            for one in c if isinstance(c, list) else [] if c is None else [c]:
                yield sse(one)
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
    extra: Callable[[], dict[str, Any]] | None = None,
) -> JSONResponse:
    """The non-streaming answer: every choice run to its end, then {id, object, created, model, choices, usage}
    and the fields `extra` gives once the run is over."""
    await run_to_end(request, gens)
    data = {
        "id": rid,
        "object": kind,
        "created": ts,
        "model": body.model,
        "choices": [choice(i, g) for i, g in enumerate(gens)],
        "usage": usage(gens, body.n),
        **(extra() if extra is not None else {}),
    }
    return JSONResponse(data, headers=headers(gens, rid))
