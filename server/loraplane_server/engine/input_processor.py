"""The one path from a prompt to what the engine queues: text encoded by the model's tokenizer, token ids
checked (empty, too long for the context, outside the vocabulary), the request's speculation method and
its KV footprint checked, its structured output compiled (a constraint that does not compile is refused here,
before anything enters the batch). `LLMEngine.add_request` runs `process` on every request; the HTTP API runs
`check_prompt` first, where it owes the client a 400 before it builds a request, and hands the engine the
`CheckedPrompt` it got, which `process` does not check again.

Everything here is fixed once the engine has started (the tokenizer, the limits) or thread-safe (the grammar
cache): any thread may call it; `check_structured` compiles a constraint off the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.errors import (
    EmptyPromptError,
    InvalidParameterError,
    InvalidPromptError,
    InvalidTokenIdError,
    PromptTooLongError,
)
from loraplane_server.executor.structured import CompiledGrammar, Grammars
from loraplane_server.sampling_params import SamplingParams, StructuredOutput


@dataclass(frozen=True)
class CheckedPrompt:
    """Prompt token ids that passed `InputProcessor.check_prompt` (only it makes one)."""

    token_ids: list[int]


@dataclass(frozen=True)
class CheckedRequest:
    """A request `InputProcessor.process` accepted: its prompt, its sampling, the speculation it runs, the
    grammar its output follows."""

    token_ids: list[int]
    params: SamplingParams
    spec_method: str  # off | ngram | draft
    grammar: CompiledGrammar | None = None  # params.structured compiled; None: free text


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        model_dir: Path,
        max_model_len: int,
        vocab_size: int,
        blocks: BlockManager,
        spec_method: Callable[[str | None], str],
        grammars: Grammars | None = None,
    ) -> None:
        """tokenizer: a transformers tokenizer, or None (token-id prompts only); spec_method: the speculation
        a request asking for one runs (refused where it cannot run here: the Speculator's `method`); blocks: the
        engine's block manager, of which only the fixed size of the KV cache is read; grammars: the engine's
        structured-output compiler (None: a model without a tokenizer, whose requests cannot be constrained)."""
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.blocks = blocks
        self.spec_method = spec_method
        self.grammars = grammars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text as the model expects it: with the tokenizer's own special tokens (a Llama 3 or Gemma BOS), as
        transformers, vLLM and TGI encode a prompt; add_special_tokens=False for text that already holds them
        (a rendered chat template), which would otherwise get a second BOS."""
        if self.tokenizer is None:
            raise InvalidPromptError(f"{self.model_dir} has no tokenizer: send token ids", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_token_ids(self, ids: list[int]) -> None:
        """InvalidTokenIdError naming the first id outside the model's vocabulary."""
        vocab = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidTokenIdError(next(t for t in ids if not 0 <= t < vocab), vocab)

    def check_sampling_ids(self, params: SamplingParams) -> None:
        """InvalidParameterError for a logit_bias id outside the model's vocabulary (a stop token id there is
        harmless: it never comes)."""
        bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                param="logit_bias",
            )

    def check_prompt(self, ids: list[int]) -> CheckedPrompt:
        """Every prompt's checks: EmptyPromptError, PromptTooLongError (no token left to generate),
        InvalidTokenIdError."""
        if not ids:
            raise EmptyPromptError()
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        self.check_token_ids(ids)
        return CheckedPrompt(ids)

    def check_structured(self, structured: StructuredOutput) -> CompiledGrammar:
        """A constraint compiled (from the cache when seen before), or InvalidParameterError naming what does not
        compile."""
        if self.grammars is None:
            raise InvalidParameterError(
                f"{self.model_dir} has no tokenizer: its outputs cannot be constrained", param="structured"
            )
        return self.grammars.compile(structured)

    def process(self, prompt: str | list[int] | CheckedPrompt, params: SamplingParams) -> CheckedRequest:
        """A request as the engine queues it, or its typed error (an EngineError)."""
        method = self.spec_method(params.speculative)
        if isinstance(prompt, CheckedPrompt):
            ids = prompt.token_ids
        else:
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.check_prompt(ids)
        total = min(len(ids) + params.max_new_tokens, self.max_model_len)
        blocks = self.blocks
        if not blocks.fits(total):
            raise InvalidPromptError(
                f"{total} tokens do not fit in the KV cache ({blocks.num_blocks} blocks of {blocks.block_size})"
            )
        self.check_sampling_ids(params)
        grammar = None if params.structured is None else self.check_structured(params.structured)
        return CheckedRequest(ids, params, method, grammar)
