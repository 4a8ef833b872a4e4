"""The engine's input processor: the one path from a prompt to a queued request (engine/input_processor.py),
on the built-in model's tokenizer, no weights loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplane_server.config import EngineConfig
from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.engine.input_processor import CheckedPrompt, InputProcessor
from loraplane_server.errors import (
    EmptyPromptError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidTokenIdError,
    PromptTooLongError,
)
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.spec.speculator import Speculator


def processor(model_dir: Path | None, max_len: int = 64, blocks: int = 8, block_size: int = 16) -> InputProcessor:
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if model_dir is not None else None
    speculator = Speculator(EngineConfig(), max_len)  # no draft model
    vocab = len(tokenizer) if tokenizer is not None else 1000
    return InputProcessor(
        tokenizer,
        model_dir or Path("/nowhere"),
        max_len,
        vocab,
        BlockManager(blocks, block_size, False),
        speculator.method,
    )


def test_text_and_ids_take_the_same_path(smollm2_dir: Path) -> None:
    inputs = processor(smollm2_dir)
    ids = inputs.encode("The capital of France is")
    from_text = inputs.process("The capital of France is", SamplingParams(max_new_tokens=4))
    from_ids = inputs.process(ids, SamplingParams(max_new_tokens=4, speculative="ngram"))
    assert from_text.token_ids == from_ids.token_ids == ids and len(ids) > 3
    assert (from_text.spec_method, from_ids.spec_method) == ("off", "ngram")


def test_every_prompt_check_names_its_error() -> None:
    inputs = processor(None)
    with pytest.raises(EmptyPromptError):
        inputs.process([], SamplingParams())
    with pytest.raises(PromptTooLongError):
        inputs.process(list(range(64)), SamplingParams())
    with pytest.raises(InvalidTokenIdError, match="1000"):
        inputs.process([1, 2, 1000], SamplingParams())
    with pytest.raises(InvalidPromptError, match="no tokenizer") as caught:
        inputs.process("text", SamplingParams())
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="--draft-model") as refused:
        inputs.process([1, 2], SamplingParams(speculative="draft"))
    assert refused.value.param == "speculative"


def test_a_checked_prompt_is_not_checked_again_but_the_kv_fit_is() -> None:
    inputs = processor(None, max_len=1 << 20, blocks=2, block_size=4)
    checked = inputs.check_prompt([1, 2, 3])
    assert isinstance(checked, CheckedPrompt) and checked.token_ids == [1, 2, 3]
    # a CheckedPrompt is taken as checked: an id the vocabulary lacks passes here, by contract
    assert inputs.process(CheckedPrompt([1, 5000]), SamplingParams(max_new_tokens=2)).token_ids == [1, 5000]
    # 3 + 6 tokens need 3 blocks of 4; the cache has 2
    with pytest.raises(InvalidPromptError, match="do not fit in the KV cache"):
        inputs.process(checked, SamplingParams(max_new_tokens=6))
