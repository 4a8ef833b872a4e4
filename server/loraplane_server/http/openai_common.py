"""What /v1/completions and /v1/chat/completions share: parameters, choices, usage, and the SSE stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from loraplane_server.http.choices import close_all, merged_events
from loraplane_server.http.errors import error_body
from loraplane_server.http.generation import Generation, TokenEvent
from loraplane_server.http.prompting import decode
from loraplane_server.http.protocol_openai import SamplingFields
from loraplane_server.http.sampling import make_params, sampling_seed, unsupported
from loraplane_server.http.sse import sse
from loraplane_server.http.state import ServerState

_NAMES = {"max_new_tokens": "max_tokens"}


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
    prompts: list[list[int]],
    max_new: list[int],
    logprobs: bool,
    arrival: float,
    adapter_id: str | None,
) -> list[Generation]:
    """body.n generations per prompt; choice i*n + j is prompt i's j-th sample (seed + j when seeded)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    gens = []
    for ids, limit in zip(prompts, max_new, strict=True):
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
            )
            gens.append(Generation(state, api, ids, params, adapter_id, arrival))
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
