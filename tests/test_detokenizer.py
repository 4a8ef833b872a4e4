"""Incremental detokenization equals a full decode after every token: SmolLM2's byte-level BPE
(with characters cut between tokens) and a SentencePiece-style decoder that drops the leading
space of the first token it decodes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplane_server.detokenizer import IncrementalText


def check_every_prefix(decode: object, ids: list[int]) -> int:
    """Feeds ids one token at a time; returns how many decode calls it took."""
    calls = 0

    def counted(x: list[int]) -> str:
        nonlocal calls
        calls += 1
        return decode(x)  # type: ignore[operator]

    inc = IncrementalText()
    for n in range(1, len(ids) + 1):
        assert inc.update(counted, ids[:n]) == decode(ids[:n]), n  # type: ignore[operator]
    return calls


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café crème, naïve façade — 東京タワー 🚀🤖 and ümlauts; def f(x):\n    return x ** 2\n",
    "  leading spaces\t\ttabs\n\nnew lines   and  doubles ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_every_prefix_matches_a_full_decode(smollm2_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text

    def decode(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=True)

    check_every_prefix(decode, ids)


def test_random_token_ids_with_cut_characters(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]  # byte tokens, partial UTF-8, specials

    def decode(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=True)

    assert "\ufffd" in decode(ids)  # the case is exercised
    calls = check_every_prefix(decode, ids)
    assert calls <= 3 * len(ids)  # a few small decodes per token, not one of the whole output


def test_sentencepiece_style_leading_space() -> None:
    vocab = {1: "▁Hello", 2: "▁world", 3: "!", 4: "▁a", 5: "b"}

    def decode(x: list[int]) -> str:
        text = "".join(vocab[i] for i in x).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text  # the first token's space is dropped

    ids = [1, 2, 3, 4, 5, 2, 2, 3]
    check_every_prefix(decode, ids)


def test_a_decoder_that_rewrites_earlier_text_falls_back_to_a_full_decode() -> None:
    def decode(x: list[int]) -> str:  # the text of a token depends on the one after it
        return "".join("A" if i + 1 < len(x) and x[i + 1] == 9 else str(t) for i, t in enumerate(x))

    check_every_prefix(decode, [1, 2, 9, 3, 9, 9, 4])
