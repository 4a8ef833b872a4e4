"""Incremental detokenization equals a full decode after every token: SmolLM2's byte-level BPE
(with characters cut between tokens) and a SentencePiece-style decoder that drops the leading
space of the first token it decodes. The deltas streamed from it add up to the final text, with
cut characters and possible stop strings held back until they settle."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplane_server.detokenizer import Detokenizer, IncrementalText


def check_every_prefix(decode: object, ids: list[int]) -> int:
    """Feeds ids one token at a time; returns how many decode calls it took."""
    calls = 0

    def counted(x: list[int]) -> str:
        nonlocal calls
        calls += 1
        return decode(x)  # type: ignore[operator]

    inc = IncrementalText()
    settled = ""
    for n in range(1, len(ids) + 1):
        settled += inc.update(counted, ids[:n])
        assert inc.text == decode(ids[:n]), n  # type: ignore[operator]
        assert inc.size == len(settled) and not settled.endswith("\ufffd")
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


def test_the_prompt_is_not_part_of_the_text() -> None:
    vocab = {1: "a", 2: "b", 3: "c"}
    inc = IncrementalText(start=2)  # ids [0, 2) are the prompt

    def decode(x: list[int]) -> str:
        return "".join(vocab[i] for i in x)

    assert inc.update(decode, [1, 2, 3]) == "c" and inc.text == "c"


# streamed deltas: Detokenizer, driven as the engine drives it
def stream(
    tokens: list[bytes], stops: list[str] | None = None, finish_at: int | None = None
) -> tuple[list[str], str, bool]:
    """Feeds the tokens (their bytes) one at a time; the deltas, the final text, and whether a stop
    string ended it. Finished after the last token, a stop string, or token number finish_at."""
    vocab = dict(enumerate(tokens))

    def decode(x: list[int]) -> str:
        return b"".join(vocab[i] for i in x).decode("utf-8", errors="replace")

    detok = Detokenizer(stops=stops)
    pieces = []
    for n in range(1, len(tokens) + 1):
        detok.update(decode, list(range(n)))
        stopped = bool(stops) and detok.find_stop()
        finished = stopped or n == len(tokens) or n == finish_at
        pieces.append(detok.delta(finished))
        if finished:
            assert "".join(pieces) == detok.text
            return pieces, detok.text, stopped
    raise AssertionError("unreachable")


def test_streamed_pieces_add_up_to_the_final_text_despite_stop_strings() -> None:
    pieces, text, stopped = stream([b"Hel", b"lo", b"\n", b"\n", b"Us", b"er:", b" more"], ["\n\nUser:"])
    assert pieces[:3] == ["Hel", "lo", ""]  # "\n" may start the stop string: held back
    assert "".join(pieces) == "Hello" and text == "Hello" and stopped  # the stop string is cut off


def test_a_cut_multibyte_character_is_held_until_complete() -> None:
    pieces, text, _ = stream([b"caf\xc3", b"\xa9", b"!"])
    assert pieces == ["caf", "\u00e9", "!"]
    assert text == "caf\u00e9!"


def test_held_back_text_is_flushed_when_the_stop_string_does_not_follow() -> None:
    pieces, text, stopped = stream([b"the E", b"n", b"d."], ["END"])
    assert pieces == ["the ", "En", "d."]  # "E" may start "END"; "En" cannot
    assert text == "the End." and not stopped


def test_a_stop_string_split_across_tokens() -> None:
    pieces, text, stopped = stream([b"ab", b"S", b"TO", b"P", b"cd"], ["STOP"])
    assert pieces == ["ab", "", "", ""] and text == "ab" and stopped


def test_a_stop_string_right_at_the_start() -> None:
    pieces, text, stopped = stream([b"STOP", b"after"], ["STOP"])
    assert pieces == [""] and text == "" and stopped
    pieces, text, stopped = stream([b"ST", b"OP!", b"after"], ["STOP"])
    assert pieces == ["", ""] and text == "" and stopped


def test_a_multibyte_character_split_over_three_tokens() -> None:
    tower = "\u6771".encode()  # 3 bytes, one token each
    pieces, text, _ = stream([b"x", tower[:1], tower[1:2], tower[2:], b"y"])
    assert pieces == ["x", "", "", "\u6771", "y"] and text == "x\u6771y"


def test_a_stop_string_inside_a_cut_character_run_and_a_stop_after_one() -> None:
    pieces, text, stopped = stream([b"a\xe6", b"\x9d", b"\xb1", b"!!"], ["\u6771!"])
    assert "".join(pieces) == text == "a" and stopped
    pieces, text, stopped = stream([b"a\xe6", b"\x9d", b"\xb1", b"!!"], ["!!"])
    assert pieces == ["a", "", "\u6771", ""] and text == "a\u6771" and stopped


def test_an_unfinished_request_flushes_everything_held() -> None:
    pieces, text, stopped = stream([b"go", b" E", b"\xc3", b"more"], ["END"], finish_at=3)
    assert pieces == ["go", " ", "E\ufffd"] and text == "go E\ufffd" and not stopped  # as a full decode shows it


def test_smollm2_deltas_add_up_to_a_full_decode(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rng = random.Random(1)
    prompt = tok.encode("A prompt that is not part of the text:", add_special_tokens=False)
    ids = prompt + [rng.randrange(tok.vocab_size) for _ in range(200)] + tok.encode(TEXTS[1], add_special_tokens=False)

    def decode(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=True)

    detok = Detokenizer(len(prompt), ["\u2603 never appears"])
    pieces = []
    for n in range(len(prompt) + 1, len(ids) + 1):
        detok.update(decode, ids[:n])
        assert not detok.find_stop()
        pieces.append(detok.delta(n == len(ids)))
        assert not pieces[-1].endswith("\ufffd") or n == len(ids)
    assert "".join(pieces) == detok.text == decode(ids[len(prompt) :])


def test_random_byte_tokens_and_stops_match_a_full_decode_cut_at_the_first_stop() -> None:
    rng = random.Random(2)
    alphabet = [b"a", b"b", b"ab", b"ba", b"\xc3", b"\xa9", b"\xe6\x9d", b"\xb1", b"\n", b" "]
    for _ in range(300):
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 14))]
        stops = [
            "".join(rng.choice(["a", "b", "\n", "\u00e9", "\ufffd"]) for _ in range(rng.randrange(1, 4)))
            for _ in range(rng.randrange(0, 3))
        ]
        pieces, text, stopped = stream(tokens, stops)
        expected, hit = "", False
        for n in range(1, len(tokens) + 1):  # the old way: the whole text each step, cut at the first stop
            expected = b"".join(tokens[:n]).decode("utf-8", errors="replace")
            hits = [i for s in stops if (i := expected.find(s)) >= 0]
            if hits:
                expected, hit = expected[: min(hits)], True
                break
            shown = "".join(pieces[:n])
            assert expected.startswith(shown), (tokens, stops, n)
        assert (text, stopped) == (expected, hit), (tokens, stops)


def wordpiece_tokenizer() -> object:
    """A WordPiece tokenizer (BERT's kind) built here, whose decode transformers cleans up (" ," -> ",")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", "hello", ",", "world", "!", "do", "n't", "'s"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)  # the spaces before punctuation left to transformers
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )  # fmt: skip


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_engines_decoder_equals_transformers_decode(smollm2_dir: Path, clean_up: bool) -> None:
    """decoder_for's fast path (the Rust decode alone) gives tokenizer.decode(ids, skip_special_tokens=True)'s text
    on SmolLM2's byte-level BPE, special tokens and cut characters included, whether or not the tokenizer asks for
    clean-up (transformers skips it for BPE); on a WordPiece tokenizer that cleans up, it keeps transformers' text."""
    from loraplane_server.detokenizer import decoder_for

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tok.clean_up_tokenization_spaces = clean_up
    decode = decoder_for(tok)
    rng = random.Random(5)
    specials = list(tok.all_special_ids)
    cases = [tok.encode(t) for t in TEXTS] + [[rng.randrange(len(tok)) for _ in range(20)] for _ in range(200)]
    cases += [[*c[:3], *specials, *c[3:]] for c in cases[:20]] + [[]]
    for ids in cases:
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
    wordpiece = wordpiece_tokenizer()
    ids = wordpiece.encode("hello, world!", add_special_tokens=True)  # type: ignore[attr-defined]
    expected = wordpiece.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert expected != wordpiece._tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert decoder_for(wordpiece)(ids) == expected
