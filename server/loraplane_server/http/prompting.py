"""Prompts to token ids: encoding, the chat template, and the context-length check (400 with the limits).

Encoding a long prompt or rendering a template takes seconds for a few MB of text: routes call these
through asyncio.to_thread, so the event loop (and /health, and every other request) keeps going.
"""

from __future__ import annotations

from loraplane_server.errors import InvalidPromptError
from loraplane_server.http.errors import ApiError, api_error
from loraplane_server.http.state import ServerState


def encode(state: ServerState, text: str) -> list[int]:
    engine, _ = state.require_engine()
    if engine.tokenizer is None:
        raise ApiError(400, f"{state.config.model_name} has no tokenizer: send token ids", code="no_tokenizer")
    return engine.tokenizer.encode(text, add_special_tokens=False)


def chat_prompt_ids(state: ServerState, messages: list[dict[str, str]]) -> list[int]:
    return encode(state, chat_prompt(state, messages))


def check_token_ids(state: ServerState, token_ids: list[int], param: str) -> list[int]:
    """A token-id prompt, 400 unless every id is in the model's vocabulary (checked before anything decodes it)."""
    engine, _ = state.require_engine()
    try:
        engine.check_token_ids(token_ids)
    except InvalidPromptError as exc:
        raise api_error(exc, param=param) from exc
    return token_ids


def decode(state: ServerState, token_ids: list[int]) -> str:
    engine, _ = state.require_engine()
    return engine.decode(token_ids)


def chat_prompt(state: ServerState, messages: list[dict[str, str]]) -> str:
    """The tokenizer's own chat template, ending with the assistant's turn."""
    engine, _ = state.require_engine()
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(
            400,
            f"{state.config.model_name} has no chat template: use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception)
        raise ApiError(
            400, f"the chat template refused these messages: {exc}", param="messages", code="invalid_messages"
        ) from exc


def check_budget(state: ServerState, ids: list[int], max_new: int | None, param: str) -> int:
    """max_new (or what is left of the context when None); 400 when the prompt (the engine's checks, run
    here before the request is built) or the total is too long."""
    engine, _ = state.require_engine()
    try:
        engine.check_prompt(ids)
    except InvalidPromptError as exc:
        raise api_error(exc) from exc
    limit, num_prompt = engine.max_model_len, len(ids)
    if max_new is None:
        return limit - num_prompt
    if num_prompt + max_new > limit:
        raise ApiError(
            400,
            f"this model's context is {limit} tokens; the prompt has {num_prompt} and "
            f"{param}={max_new} asks for {num_prompt + max_new} in all: reduce the prompt or {param} "
            f"(at most {limit - num_prompt} here)",
            param=param,
            code="context_length_exceeded",
        )
    return max_new
