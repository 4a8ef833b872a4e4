"""LoRAX / TGI request and response bodies (POST /, /generate, /generate_stream)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.http.protocol_openai import REPETITION_PENALTY_DOC, TEMPERATURE_DOC, TOP_P_DOC
from loraplane_server.http.valid_text import ValidText
from loraplane_server.sampling_params import MIN_REPETITION_PENALTY

MAX_STOP = 16


class LoraxParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    adapter_id: str | None = Field(default=None, max_length=1024, description="adapter to apply; none: the base model")
    adapter_source: str | None = Field(
        default=None,
        max_length=2048,
        description="register adapter_id on the fly: hub | local | s3 (LoRAX kinds) or a source URI; "
        "subject to the server's allowlist",
    )
    api_token: str | None = None
    merged_adapters: dict | None = Field(default=None, description="not supported; must be absent")
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
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    best_of: int | None = Field(default=None, ge=1, le=1)
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_k_alternatives: int | None = Field(default=None, ge=0, le=0)
    response_format: dict | None = Field(default=None, description="not supported; must be absent")


class GenerateRequest(ValidText):
    """Every string, in parameters too, must be valid Unicode (a lone surrogate is a 400 naming the field)."""

    inputs: str = Field(min_length=1)
    parameters: LoraxParameters = Field(default_factory=lambda: LoraxParameters())
    stream: bool = False


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


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
