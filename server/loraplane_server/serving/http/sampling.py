"""What a request gives the engine: prompt token ids, SamplingParams, and strings that are valid Unicode.

Prompts: encoding, the chat template, and the context-length check (400 with the limits). Encoding a long
prompt or rendering a template takes seconds for a few MB of text: routes call these through
asyncio.to_thread, so the event loop (and /health, and every other request) keeps going.

Sampling: the engine's SamplingParams from an API's fields; an out-of-range value is a 422 naming the field.

Valid text: JSON may carry a lone surrogate ("\\udfff"); Python's json keeps it in the str, and the tokenizer,
the chat template or a UTF-8 encoder then fail deep inside a request. Body models deriving from `ValidText`
refuse such a string up front, as a pydantic error of pydantic's own type for bad Unicode (UNICODE_ERROR),
which the error handler answers with a 400 naming the field.
"""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import BaseModel, field_validator
from pydantic_core import PydanticCustomError

from loraplane_server.engine.input_processor import CheckedPrompt
from loraplane_server.errors import InvalidParameterError, InvalidPromptError
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.serving.http.errors import UNICODE_ERROR, ApiError, api_error
from loraplane_server.serving.http.state import ServerState


# prompts
def encode(state: ServerState, text: str) -> list[int]:
    """The engine's own encoding (its input processor: the server starts only with a tokenizer)."""
    engine, _ = state.require_engine()
    return engine.inputs.encode(text)


def chat_prompt_ids(state: ServerState, messages: list[dict[str, str]]) -> list[int]:
    return encode(state, chat_prompt(state, messages))


def check_token_ids(state: ServerState, token_ids: list[int], param: str) -> list[int]:
    """A token-id prompt, 400 unless every id is in the model's vocabulary (checked before anything decodes it)."""
    engine, _ = state.require_engine()
    try:
        engine.inputs.check_token_ids(token_ids)
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


def check_budget(state: ServerState, ids: list[int], max_new: int | None, param: str) -> tuple[CheckedPrompt, int]:
    """The prompt as the engine's input processor checked it (its checks run here, before the request is
    built: a 400 when they fail), and max_new (or what is left of the context when None); a 400 when the
    total is too long."""
    engine, _ = state.require_engine()
    try:
        prompt = engine.inputs.check_prompt(ids)
    except InvalidPromptError as exc:
        raise api_error(exc) from exc
    limit, num_prompt = engine.max_model_len, len(ids)
    if max_new is None:
        return prompt, limit - num_prompt
    if num_prompt + max_new > limit:
        raise ApiError(
            400,
            f"this model's context is {limit} tokens; the prompt has {num_prompt} and "
            f"{param}={max_new} asks for {num_prompt + max_new} in all: reduce the prompt or {param} "
            f"(at most {limit - num_prompt} here)",
            param=param,
            code="context_length_exceeded",
        )
    return prompt, max_new


# sampling
def make_params(names: dict[str, str], **fields: object) -> SamplingParams:
    """SamplingParams(**fields); `names` maps an engine field to the API's name for error messages."""
    try:
        return SamplingParams(**fields)  # type: ignore[arg-type]
    except InvalidParameterError as exc:
        raise api_error(exc, param=names.get(exc.param, exc.param)) from exc


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(422, f"{param}: {what} is not supported by this server", param=param, code="unsupported_parameter")


def sampling_seed(seed: int | None, is_sampling: bool) -> int | None:
    """A sampled request without a seed gets a random one, reported back so it can be replayed."""
    if seed is None and is_sampling:
        return random.getrandbits(63)
    return seed


# valid text
def find_invalid_text(value: Any, path: str = "") -> str | None:
    """The path (relative to value, e.g. "[0].content") of the first string that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f".{_printable(key)}"
            found = path + name if not _is_valid(key) else find_invalid_text(item, path + name)
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if type(item) is int:
                continue  # token ids: the common long list
            found = find_invalid_text(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _is_all_valid(value: Any) -> bool:
    """One pass in C over every string of value (the walk above, in Python, only runs to find a bad one)."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_valid(key: object) -> bool:
    return not isinstance(key, str) or find_invalid_text(key) is None


def _printable(key: object) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class ValidText(BaseModel):
    """A body model whose every string, nested ones included, is valid Unicode (checked before parsing)."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _is_all_valid(value):
            return value
        path = find_invalid_text(value)
        if path is not None:
            raise PydanticCustomError(
                UNICODE_ERROR,
                "not valid Unicode (a lone surrogate such as \\udfff): send UTF-8 text",
                {"path": path},
            )
        return value
