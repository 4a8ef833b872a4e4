"""OpenAI request bodies (/v1/completions, /v1/chat/completions); responses are built as plain dicts.

No field is ever silently dropped: a field these models do not know is a 400 naming it (extra="forbid"), and
a field they know but the server does not honour is accepted only at the values that change nothing (`only`:
its default, or an equivalent such as presence_penalty 0); any other value is refused by name
(sampling.unhonoured). Fields that are pure metadata with no effect on the output (user, metadata,
safety_identifier, prompt_cache_key, vLLM's session_id) are accepted as no-ops: honouring them is doing nothing.

The OpenAI fields are those of the openai package's CompletionCreateParams (3.57); vLLM's extensions are those
of vLLM 0.32.0's CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/{completion,chat_completion}
/protocol.py), plus its removed guided_* fields, which are honoured here (vLLM 0.32 drops them silently).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.sampling_params import (
    GREEDY_BELOW,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_TOP_P,
)
from loraplane_server.serving.http.sampling import ValidText, only
from loraplane_server.serving.http.structured_output import NonEmpty, ResponseFormat, StructuredOutputs
from loraplane_server.serving.http.tools import ToolChoice, ToolDef

MAX_STOP = 16
MAX_TOKEN_ID = (1 << 31) - 1
TEMPERATURE_DOC = f"0 is greedy; so is any value below {GREEDY_BELOW:g} (as in vLLM)"
TOP_P_DOC = f"below {MIN_TOP_P:g} counts as {MIN_TOP_P:g} (float32's range): either keeps the top token alone"
REPETITION_PENALTY_DOC = (
    f"1 is off; at least {MIN_REPETITION_PENALTY:g}: a penalty p divides seen tokens' positive logits by p, "
    "and a tinier p would overflow them"
)
SPECULATIVE_DOC = (
    "loraplane extension: this request's speculative decoding: off, ngram (prompt lookup) or draft (the "
    "server's --draft-model proposes); none: the server's default"
)
NOOP_DOC = "accepted and has no effect on the output (pure metadata)"
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# printable ASCII without spaces: it goes into the response id and the x-request-id header
REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,256}$"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = only(None, False, what="stream obfuscation")


class SamplingFields(ValidText):
    """What the two OpenAI routes share, plus vLLM's extensions (top_k, repetition_penalty, ignore_eos,
    stop_token_ids, structured outputs, prompt truncation, and the ones accepted only at their defaults).

    Every string must be valid Unicode (a lone surrogate is a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=1024, description="the base model's name, or an adapter id")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description=TEMPERATURE_DOC)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description=TOP_P_DOC)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20, description="vLLM extension; -1 or 0 disables it")
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=10.0, description=f"vLLM extension; {REPETITION_PENALTY_DOC}"
    )
    presence_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0, description="subtracted from the logit of every token generated so far"
    )
    frequency_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0, description="subtracted from a token's logit once per time it was generated"
    )
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=1024, description=NOOP_DOC)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = Field(
        default=None,
        max_length=1024,
        description="token id (as a string) -> a bias added to its logit, in [-100, 100]",
    )
    speculative: Literal["off", "ngram", "draft"] | None = Field(default=None, description=SPECULATIVE_DOC)

    # structured output: at most one of these (two are a 400 naming both)
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object, or json_schema (strict or not, the output follows the schema)"
    )
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM extension")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's former extension")
    guided_regex: NonEmpty | None = Field(default=None, description="vLLM's former extension")
    guided_choice: list[NonEmpty] | None = Field(default=None, min_length=1, description="vLLM's former extension")
    guided_grammar: NonEmpty | None = Field(default=None, description="vLLM's former extension: EBNF, a root rule")
    guided_decoding_backend: str | None = Field(default=None, description="xgrammar or auto (both: xgrammar)")
    guided_whitespace_pattern: str | None = only(None, what="guided_whitespace_pattern")

    # vLLM's extensions this server honours
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    stop_token_ids: list[TokenId] | None = Field(
        default=None, max_length=256, description="vLLM extension: these token ids end the output too"
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, le=1 << 31, description="vLLM extension: keep this many prompt tokens (-1: what fits)"
    )
    truncation_side: Literal["left", "right"] | None = Field(
        default=None,
        description="vLLM extension: left keeps the last tokens, right the first; none: the tokenizer's side",
    )
    request_id: str | None = Field(
        default=None, pattern=REQUEST_ID_PATTERN, description="vLLM extension: the response's id ends with it"
    )
    session_id: str | None = Field(default=None, max_length=1024, description=f"vLLM extension; {NOOP_DOC}")

    min_p: float | None = Field(
        default=None, ge=0.0, le=1.0, description="vLLM extension: sample tokens over min_p x the top's probability"
    )

    # vLLM's extensions accepted only at the values that change nothing
    use_beam_search: bool = only(False, what="beam search")
    length_penalty: float = only(1.0, what="length_penalty (beam search)")
    watermarking: bool | None = only(None, False, what="watermarking")
    include_stop_str_in_output: bool = only(False, what="include_stop_str_in_output")
    min_tokens: int = only(0, what="min_tokens")
    skip_special_tokens: bool = only(True, what="skip_special_tokens false")
    spaces_between_special_tokens: bool = only(True, what="spaces_between_special_tokens false")
    allowed_token_ids: list[int] | None = only(None, what="allowed_token_ids")
    bad_words: list[str] | None = only(None, [], what="bad_words")
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="vLLM extension: each prompt token's logprob given those before it, with this many alternatives",
    )
    logprob_token_ids: list[int] | None = only(None, what="logprob_token_ids")
    priority: int = only(0, what="request priority")
    return_tokens_as_token_ids: bool | None = only(None, False, what="return_tokens_as_token_ids")
    return_token_ids: bool | None = only(None, False, what="return_token_ids")
    return_token_offsets: bool | None = only(False, None, what="return_token_offsets")
    routed_experts_prompt_start: int = only(0, what="routed expert data")
    mm_payload: str = only("tensors", what="a multimodal payload")
    return_mm_kwargs: bool | None = only(None, what="a multimodal payload")
    cache_salt: str | None = only(None, what="cache_salt (a per-request prefix-cache salt)")
    kv_transfer_params: dict[str, Any] | None = only(None, what="disaggregated serving (kv_transfer_params)")
    ec_transfer_params: dict[str, Any] | None = only(None, what="disaggregated serving (ec_transfer_params)")
    vllm_xargs: dict[str, Any] | None = only(None, what="vllm_xargs")
    repetition_detection: dict[str, Any] | None = only(None, what="repetition_detection")
    thinking_token_budget: int | None = only(None, what="thinking_token_budget")
    stream_interval: int | None = only(None, 1, what="a stream_interval above 1 (every token is sent)")

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="text, token ids, or a batch")
    max_tokens: int | None = Field(default=16, ge=1, le=1 << 20)
    echo: bool = False
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="the sampled tokens' logprobs, and this many most likely alternatives per position",
    )
    suffix: str | None = only(None, "", what="suffix (insertion)")
    best_of: int | None = Field(default=None, ge=1, le=1, description="only 1 is supported")
    add_special_tokens: bool = Field(
        default=True, description="vLLM extension: text prompts get the tokenizer's special tokens (a BOS)"
    )
    prompt_embeds: str | list[str] | None = only(None, what="prompt_embeds")


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(description="its arguments as JSON text")


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (as the response gave it)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, max_length=1024)
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message as the chat template reads it: role, content (text or text parts), name, tool_call_id and an
    assistant turn's tool_calls. Refusals, audio and function calls are not supported: only their empty values
    are accepted."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(default=None, max_length=1024, description="handed to the chat template")
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="an assistant turn's calls")
    refusal: str | None = only(None, what="an assistant refusal")
    function_call: dict[str, Any] | None = only(None, what="function calling")
    audio: dict[str, Any] | None = only(None, what="audio")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: this many most likely tokens per position"
    )
    tools: list[ToolDef] | None = Field(default=None, max_length=128, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or {type: function, function: {name}}"
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call per answer")
    functions: list[dict[str, Any]] | None = only(None, [], what="function calling")
    function_call: str | dict[str, Any] | None = only(None, "none", what="function calling")
    # OpenAI's fields that are metadata (no-ops), or features this server does not have
    metadata: dict[str, str] | None = Field(default=None, max_length=16, description=NOOP_DOC)
    store: bool | None = only(None, False, what="storing completions")
    safety_identifier: str | None = Field(default=None, max_length=1024, description=NOOP_DOC)
    prompt_cache_key: str | None = Field(
        default=None, max_length=1024, description="a caching hint: the prefix cache works without it; no-op"
    )
    prompt_cache_options: dict[str, Any] | None = only(None, what="prompt cache options")
    prompt_cache_retention: str | None = only(None, what="prompt cache retention")
    service_tier: str | None = only(None, "auto", "default", what="a service tier other than auto or default")
    modalities: list[str] | None = only(None, ["text"], what="an output modality other than text")
    audio: dict[str, Any] | None = only(None, what="audio output")
    prediction: dict[str, Any] | None = only(None, what="a predicted output")
    web_search_options: dict[str, Any] | None = only(None, what="web search")
    reasoning_effort: str | None = only(None, what="reasoning_effort")
    verbosity: str | None = only(None, what="verbosity")
    moderation: dict[str, Any] | None = only(None, what="moderation")
    # vLLM's chat extensions
    add_generation_prompt: bool = Field(default=True, description="vLLM extension: end with the assistant's turn")
    continue_final_message: bool = Field(
        default=False, description="vLLM extension: continue the last (assistant) message; not with the above"
    )
    add_special_tokens: bool = Field(
        default=False,
        description="vLLM extension: add the tokenizer's special tokens on top of the template's (which has a "
        "BOS already where the model wants one)",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM extension: variables for the chat template (only ones it reads)"
    )
    echo: bool = only(False, what="echo on chat completions")
    documents: list[dict[str, str]] | None = only(None, what="passing documents to the chat template (RAG)")
    chat_template: str | None = only(None, what="a per-request chat template")
    media_io_kwargs: dict[str, Any] | None = only(None, what="multimodal input")
    mm_processor_kwargs: dict[str, Any] | None = only(None, what="multimodal input")
    include_reasoning: bool = only(True, what="include_reasoning false (no reasoning parser)")
    return_prompt_text: bool | None = only(None, False, what="return_prompt_text")
