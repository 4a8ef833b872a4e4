"""Prompts to token ids: encoding, the chat template, and the context-length check (400 with the limits).

Encoding a long prompt or rendering a template takes seconds for a few MB of text: routes call these
through asyncio.to_thread, so the event loop (and /health, and every other request) keeps going.
"""

from __future__ import annotations

from loraplane_server.http.errors import ApiError
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
    vocab = engine.runner.model.args.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param=param, code="invalid_token_id"
        )
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


def check_budget(state: ServerState, num_prompt: int, max_new: int | None, param: str) -> int:
    """max_new (or what is left of the context when None); 400 when the prompt or the total is too long."""
    engine, _ = state.require_engine()
    limit = engine.max_model_len
    if num_prompt == 0:
        raise ApiError(400, "the prompt is empty", code="empty_prompt")
    if num_prompt >= limit:
        raise ApiError(
            400,
            f"the prompt has {num_prompt} tokens; this model's context is {limit} tokens and at "
            "least one must be left to generate: shorten the prompt",
            code="context_length_exceeded",
        )
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
