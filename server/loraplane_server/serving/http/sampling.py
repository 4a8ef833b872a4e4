"""What a request gives the engine: prompt token ids, SamplingParams, and strings that are valid Unicode.

Prompts: encoding, the chat template, and the context-length check (400 with the limits). Encoding a long
prompt or rendering a template takes seconds for a few MB of text: routes call these through
asyncio.to_thread, so the event loop (and /health, and every other request) keeps going.

Sampling: the engine's SamplingParams from an API's fields; an out-of-range value is a 422 naming the field, and
so is a field the server knows but does not honour, at any value but those that change nothing (`only`).

Valid text: JSON may carry a lone surrogate ("\\udfff"); Python's json keeps it in the str, and the tokenizer,
the chat template or a UTF-8 encoder then fail deep inside a request. Body models deriving from `ValidText`
refuse such a string up front, as a pydantic error of pydantic's own type for bad Unicode (UNICODE_ERROR),
which the error handler answers with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import random
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateSyntaxError, meta, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from loraplane_server.engine.input_processor import CheckedPrompt
from loraplane_server.errors import InvalidParameterError, InvalidPromptError
from loraplane_server.sampling_params import SamplingParams, StructuredOutput
from loraplane_server.serving.http.errors import UNICODE_ERROR, ApiError, api_error
from loraplane_server.serving.http.state import ServerState
from loraplane_server.serving.http.tools import tools_in_messages


# prompts
def encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    """The engine's own encoding (its input processor: the server starts only with a tokenizer). A raw text
    prompt gets the tokenizer's special tokens, as transformers, vLLM and TGI give it (a Llama 3 or Gemma base
    model expects its BOS); a rendered chat template already holds them, so it is encoded without."""
    engine, _ = state.require_engine()
    return engine.inputs.encode(text, add_special_tokens=add_special_tokens)


@dataclass(frozen=True)
class ChatOptions:
    """How messages become a prompt (vLLM's chat extensions): the template's generation prompt or a continued
    final message, the template's own variables, and special tokens on top of the template's (off: vLLM's
    rule, since a template that wants a BOS writes it)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # the request's tools (serving/http/tools.py), for the template


def template_mentions(state: ServerState, text: str) -> bool:
    """Whether the model's chat template's source names this (a message field such as tool_calls)."""
    engine, _ = state.require_engine()
    template = getattr(engine.tokenizer, "chat_template", None)
    return isinstance(template, str) and text in template


def chat_prompt_ids(
    state: ServerState, messages: list[dict[str, Any]], options: ChatOptions | None = None
) -> list[int]:
    """A chat prompt's token ids: the template's text, encoded without adding special tokens a second time."""
    options = options or ChatOptions()
    return encode(state, chat_prompt(state, messages, options), add_special_tokens=options.add_special_tokens)


async def compile_ahead(state: ServerState, structured: StructuredOutput | None, param: str) -> None:
    """A constraint compiled on a worker thread before its request reaches the engine (a schema may take a few
    hundred ms: neither the event loop nor the engine's step waits for it; the engine then finds it in the
    cache); one that does not compile is a 400 naming the request's field (`param`) and why."""
    if structured is None:
        return
    engine, _ = state.require_engine()
    try:
        await asyncio.to_thread(engine.inputs.check_structured, structured)
    except InvalidParameterError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_constraint") from exc


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


def chat_prompt(state: ServerState, messages: list[dict[str, Any]], options: ChatOptions | None = None) -> str:
    """The tokenizer's own chat template, ending with the assistant's turn (or continuing the last message)."""
    options = options or ChatOptions()
    engine, _ = state.require_engine()
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(
            400,
            f"{state.config.model_name} has no chat template: use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    if options.add_generation_prompt and options.continue_final_message:
        raise ApiError(
            400,
            "continue_final_message needs add_generation_prompt false: the prompt either opens the assistant's "
            "turn or continues the last message",
            param="continue_final_message",
        )
    check_template_kwargs(tok, options.template_kwargs)
    tools = options.tools
    if tools and "tools" not in template_variables(str(tok.chat_template)):
        messages, tools = tools_in_messages(messages, tools), None  # shown in a system message instead
    try:
        return tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=False,
            **options.template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception)
        raise ApiError(
            400, f"the chat template refused these messages: {exc}", param="messages", code="invalid_messages"
        ) from exc


# what the render call of apply_chat_template sets itself (its parameters are read off its signature)
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception"})


def check_template_kwargs(tok: Any, kwargs: dict[str, Any]) -> None:
    """chat_template_kwargs may only set variables the chat template reads (vLLM drops the others silently;
    here they are a 400 naming them), never what apply_chat_template sets itself or a special token."""
    if not kwargs:
        return
    params = inspect.signature(tok.apply_chat_template).parameters.values()
    own = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    reserved = _RESERVED_TEMPLATE_NAMES | own | set(getattr(tok, "special_tokens_map", {}) or {})
    used = template_variables(str(tok.chat_template)) - reserved
    unused = sorted(k for k in kwargs if k not in used)
    if unused:
        names = ", ".join(f"chat_template_kwargs.{k}" for k in unused)
        reads = ", ".join(sorted(used)) or "none"
        raise ApiError(
            400,
            f"{names}: this model's chat template does not read {'it' if len(unused) == 1 else 'them'} "
            f"(the variables a request may set here: {reads})",
            param=f"chat_template_kwargs.{unused[0]}",
            code="unknown_template_variable",
        )


class _GenerationTag(Extension):
    """transformers' {% generation %} ... {% endgeneration %} block, parsed only (to read a template's variables)."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (as vLLM finds them, with jinja's own parser)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except TemplateSyntaxError:
        return frozenset()  # apply_chat_template reports the template's own error


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


ONLY_VALUES = "x-only-values"  # the values of an `only` field that change nothing (in its OpenAPI schema too)
ONLY_WHAT = "x-unsupported"


def only(*allowed: Any, what: str) -> Any:
    """A field the server knows but does not honour: accepted at `allowed` (its default first), the values that
    change nothing, so that a client sending the default is served; any other value is refused by name
    (`unhonoured`) instead of being dropped."""
    shown = " or ".join(json.dumps(v) for v in allowed)
    return Field(
        default=allowed[0],
        description=f"{what}: not supported; only {shown} is accepted",
        json_schema_extra={ONLY_VALUES: list(allowed), ONLY_WHAT: what},
    )


def unhonoured(body: BaseModel, prefix: str = "") -> tuple[str, str] | None:
    """(the field's dotted name, what it asks for) of the first `only` field, nested ones included, that holds a
    value the server would not honour; None when every field is honoured."""
    for name, info in type(body).model_fields.items():
        value = getattr(body, name)
        path = prefix + (info.alias or name)
        extra = info.json_schema_extra
        if isinstance(extra, dict) and ONLY_VALUES in extra and value not in extra[ONLY_VALUES]:  # type: ignore[operator]
            return path, str(extra[ONLY_WHAT])
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                found = unhonoured(item, f"{path}." if i is None else f"{path}.{i}.")
                if found is not None:
                    return found
    return None


def check_honoured(body: BaseModel, prefix: str = "") -> None:
    """A 422 naming the first field of body that holds a value the server would not honour."""
    found = unhonoured(body, prefix)
    if found is not None:
        raise unsupported(*found)


def truncated(ids: list[int], keep: int | None, side: str) -> list[int]:
    """ids cut to `keep` tokens: left drops the first ones (the end of the prompt is kept), right the last."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[len(ids) - keep :] if side == "left" else ids[:keep]


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
