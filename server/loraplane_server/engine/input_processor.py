"""The one path from a prompt to what the engine queues: text encoded by the model's tokenizer, token ids
checked (empty, too long for the context, outside the vocabulary), the request's speculation method and
its KV footprint checked. `LLMEngine.add_request` runs `process` on every request; the HTTP API runs
`check_prompt` first, where it owes the client a 400 before it builds a request, and hands the engine the
`CheckedPrompt` it got, which `process` does not check again.

Everything here is fixed once the engine has started (the tokenizer, the limits): any thread may call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.errors import (
    EmptyPromptError,
    InvalidPromptError,
    InvalidTokenIdError,
    PromptTooLongError,
)
from loraplane_server.sampling_params import SamplingParams


@dataclass(frozen=True)
class CheckedPrompt:
    """Prompt token ids that passed `InputProcessor.check_prompt` (only it makes one)."""

    token_ids: list[int]


@dataclass(frozen=True)
class CheckedRequest:
    """A request `InputProcessor.process` accepted: its prompt, its sampling, the speculation it runs."""

    token_ids: list[int]
    params: SamplingParams
    spec_method: str  # off | ngram | draft


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        model_dir: Path,
        max_model_len: int,
        vocab_size: int,
        blocks: BlockManager,
        spec_method: Callable[[str | None], str],
    ) -> None:
        """tokenizer: a transformers tokenizer, or None (token-id prompts only); spec_method: the speculation
        a request asking for one runs (refused where it cannot run here: the Speculator's `method`); blocks: the
        engine's block manager, of which only the fixed size of the KV cache is read."""
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.blocks = blocks
        self.spec_method = spec_method

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidPromptError(f"{self.model_dir} has no tokenizer: send token ids", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_token_ids(self, ids: list[int]) -> None:
        """InvalidTokenIdError naming the first id outside the model's vocabulary."""
        vocab = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidTokenIdError(next(t for t in ids if not 0 <= t < vocab), vocab)

    def check_prompt(self, ids: list[int]) -> CheckedPrompt:
        """Every prompt's checks: EmptyPromptError, PromptTooLongError (no token left to generate),
        InvalidTokenIdError."""
        if not ids:
            raise EmptyPromptError()
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        self.check_token_ids(ids)
        return CheckedPrompt(ids)

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
        if blocks.blocks_needed(total) > blocks.num_blocks:
            raise InvalidPromptError(
                f"{total} tokens do not fit in the KV cache ({blocks.num_blocks} blocks of {blocks.block_size})"
            )
        return CheckedRequest(ids, params, method)
