"""OpenAI request bodies (/v1/completions, /v1/chat/completions); responses are built as plain dicts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.sampling_params import GREEDY_BELOW, MIN_REPETITION_PENALTY, MIN_TOP_P
from loraplane_server.serving.http.sampling import ValidText

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


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(ValidText):
    """What the two OpenAI routes share, plus vLLM's extensions (top_k, repetition_penalty, ignore_eos).

    Every string must be valid Unicode (a lone surrogate is a 400 naming the field)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=1024, description="the base model's name, or an adapter id")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description=TEMPERATURE_DOC)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description=TOP_P_DOC)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20, description="vLLM extension; -1 or 0 disables it")
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=10.0, description=f"vLLM extension; {REPETITION_PENALTY_DOC}"
    )
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="only 0 is supported")
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="only 0 is supported")
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    user: str | None = Field(default=None, max_length=1024)
    logit_bias: dict[str, float] | None = Field(default=None, description="only an empty map is supported")
    speculative: Literal["off", "ngram", "draft"] | None = Field(default=None, description=SPECULATIVE_DOC)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="text, token ids, or a batch")
    max_tokens: int | None = Field(default=16, ge=1, le=1 << 20)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=0, description="0: the sampled tokens' logprobs")
    suffix: str | None = Field(default=None, description="not supported; must be absent")
    best_of: int | None = Field(default=None, ge=1, le=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0, description="only 0 is supported")
    response_format: dict | None = Field(default=None, description="only {'type': 'text'} is supported")
    tools: list[dict] | None = Field(default=None, description="not supported; must be absent or empty")
    tool_choice: str | dict | None = Field(default=None, description="only 'none' is supported")
