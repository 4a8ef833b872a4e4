"""bench/accuracy.py, issue 24's accuracy harness: its perplexity against transformers' on the same tokens,
its windows, greedy agreement on hand-made outputs, and identical engines agreeing entirely."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from engine_helpers import make_engine

from loraplane_server.engine.llm_engine import LLMEngine

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load_accuracy() -> ModuleType:
    """bench/accuracy.py by its path: bench/ is a directory of scripts, not a package on sys.path."""
    spec = importlib.util.spec_from_file_location("bench_accuracy", BENCH / "accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


accuracy = _load_accuracy()
TEXT = accuracy.EVAL_TEXT.read_text()
PROMPTS: list[str] = json.loads(accuracy.EVAL_PROMPTS.read_text())


@pytest.fixture(scope="module")
def fp32_engine(smollm2_dir: Path) -> LLMEngine:
    return make_engine(smollm2_dir, num_kv_blocks=128)


@pytest.fixture(scope="module")
def bf16_engine(smollm2_dir: Path) -> LLMEngine:
    return make_engine(smollm2_dir, dtype="bfloat16", num_kv_blocks=128)


@pytest.fixture(scope="module")
def fp32_perplexity(fp32_engine: LLMEngine) -> float:
    return accuracy.perplexity(fp32_engine, TEXT, window=512)


def hf_perplexity(model_dir: Path, ids: list[int], window: int) -> float:
    """Reference: transformers in float32 on the same tokens, non-overlapping windows written out plainly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for begin in range(0, len(ids), window):
        chunk = ids[begin : begin + window]
        if len(chunk) < 2:
            continue
        with torch.no_grad():
            logp = model(torch.tensor([chunk])).logits[0, :-1].double().log_softmax(-1)  # [n - 1, V]
        nll -= logp.gather(1, torch.tensor(chunk[1:])[:, None]).sum().item()
        count += len(chunk) - 1
    return math.exp(nll / count)


# the data
def test_eval_data_is_the_size_the_bench_expects() -> None:
    assert 2500 <= len(TEXT.split()) <= 3500
    assert len(PROMPTS) == 24 and all(isinstance(p, str) and p.strip() for p in PROMPTS)
    assert len(set(PROMPTS)) == len(PROMPTS)


# windows
@pytest.mark.parametrize(
    ("num_tokens", "window", "stride", "expected"),
    [
        (10, 4, None, [(0, 4, 1), (4, 8, 5), (8, 10, 9)]),
        (9, 4, None, [(0, 4, 1), (4, 8, 5)]),  # the last window's one token has no context: unscored
        (10, 4, 2, [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]),
        (3, 8, None, [(0, 3, 1)]),
        (1, 8, None, []),
    ],
)
def test_spans(num_tokens: int, window: int, stride: int | None, expected: list[tuple[int, int, int]]) -> None:
    got = accuracy.spans(num_tokens, window, stride)
    assert [(s.begin, s.end, s.first_scored) for s in got] == expected


def test_strided_spans_score_every_token_but_the_first_once() -> None:
    for stride in (1, 3, 64, 99):
        got = accuracy.spans(1000, 100, stride)
        scored = [i for s in got for i in range(s.first_scored, s.end)]
        assert scored == list(range(1, 1000))
        assert all(s.end - s.begin <= 100 for s in got)
    plain = accuracy.spans(1000, 100)  # non-overlapping: each window's first token is left out
    assert [i for s in plain for i in range(s.first_scored, s.end)] == [i for i in range(1000) if i % 100]


@pytest.mark.parametrize(("window", "stride"), [(1, None), (8, 0), (8, 9)])
def test_bad_windows_are_refused(window: int, stride: int | None) -> None:
    with pytest.raises(ValueError):
        accuracy.spans(100, window, stride)


# greedy agreement on hand-made outputs
def test_greedy_agreement_is_position_wise() -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert accuracy.greedy_agreement(a, a, n=4) == 1.0
    assert accuracy.greedy_agreement(a, [[1, 2, 3, 4], [5, 0, 7, 8]], n=4) == 7 / 8  # agrees again after 0
    assert accuracy.greedy_agreement(a, [[9, 9, 9, 9], [9, 9, 9, 9]], n=4) == 0.0
    assert accuracy.greedy_agreement(a, [[1, 2, 0, 0], [0, 6, 7, 8]], n=4) == 5 / 8


def test_greedy_agreement_counts_the_first_n_tokens_alone() -> None:
    a = [[1, 2, 3, 4, 5, 6]]
    b = [[1, 2, 0, 4, 0, 0]]
    assert accuracy.greedy_agreement(a, b, n=2) == 1.0
    assert accuracy.greedy_agreement(a, b, n=4) == 3 / 4
    assert accuracy.greedy_agreement(a, b, n=32) == 3 / 6


def test_greedy_agreement_counts_a_missing_token_as_a_disagreement() -> None:
    assert accuracy.greedy_agreement([[1, 2, 3, 4]], [[1, 2]], n=4) == 2 / 4
    assert accuracy.greedy_agreement([[1, 2], [3]], [[1, 2, 7], [3]], n=4) == 3 / 4


def test_greedy_agreement_refuses_what_cannot_be_compared() -> None:
    with pytest.raises(ValueError):
        accuracy.greedy_agreement([[1]], [[1], [2]])
    with pytest.raises(ValueError):
        accuracy.greedy_agreement([[]], [[]])


def test_common_prefixes() -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2], [4, 4, 4]]
    b = [[1, 2, 3, 4], [5, 0, 7, 8], [1, 2, 3], [0, 4, 4]]
    assert accuracy.common_prefixes(a, b, n=4) == [4, 1, 2, 0]
    assert accuracy.common_prefixes(a, b, n=2) == [2, 1, 2, 0]


# the engine's perplexity
def test_fp32_perplexity_equals_transformers_on_the_same_tokens(
    fp32_engine: LLMEngine, fp32_perplexity: float, smollm2_dir: Path
) -> None:
    ids = accuracy.text_ids(fp32_engine, TEXT)
    assert 3000 <= len(ids) <= 6000  # a few thousand tokens, several windows (4,243 measured)
    assert fp32_perplexity == pytest.approx(hf_perplexity(smollm2_dir, ids, 512), rel=1e-4)  # measured 2e-8 apart
    assert 10 < fp32_perplexity < 30  # 18.14 measured: ordinary text to this model


def test_score_window_gives_the_kv_blocks_back(fp32_engine: LLMEngine) -> None:
    free = fp32_engine.block_manager.num_free_blocks
    ids = accuracy.text_ids(fp32_engine, TEXT)[:300]
    logprobs, top1 = accuracy.score_window(fp32_engine, ids, first_scored=100)
    assert logprobs.shape == top1.shape == (200,)
    assert bool((logprobs <= 0).all()) and bool(torch.isfinite(logprobs).all())
    assert fp32_engine.block_manager.num_free_blocks == free and not fp32_engine.has_unfinished


def test_a_strided_pass_scores_with_more_context(fp32_engine: LLMEngine) -> None:
    """Overlapping windows give every scored token more context: a lower perplexity, the same tokens scored."""
    ids = accuracy.text_ids(fp32_engine, TEXT)[:1024]
    plain = accuracy.score_tokens(fp32_engine, ids, window=256)
    strided = accuracy.score_tokens(fp32_engine, ids, window=256, stride=128)
    assert len(strided.logprobs) == len(ids) - 1 > len(plain.logprobs)
    assert strided.perplexity < plain.perplexity


def test_bf16_perplexity_is_close_to_fp32(bf16_engine: LLMEngine, fp32_perplexity: float) -> None:
    """The bf16 kernels' perplexity: within 1% of fp32 (18.155 against 18.143 measured, 0.07%)."""
    assert accuracy.perplexity(bf16_engine, TEXT) == pytest.approx(fp32_perplexity, rel=0.01)


# greedy outputs
def test_identical_engines_agree_entirely(bf16_engine: LLMEngine, smollm2_dir: Path) -> None:
    twin = make_engine(smollm2_dir, dtype="bfloat16", num_kv_blocks=128)
    a = accuracy.greedy_outputs(bf16_engine, PROMPTS, n=32)
    b = accuracy.greedy_outputs(twin, PROMPTS, n=32)
    assert [len(x) for x in a] == [32] * len(PROMPTS)  # eos ignored: exactly n tokens
    assert accuracy.greedy_agreement(a, b, n=32) == 1.0
    assert accuracy.common_prefixes(a, b, n=32) == [32] * len(PROMPTS)
    ids = accuracy.text_ids(twin, TEXT)[:600]
    assert torch.equal(accuracy.score_tokens(bf16_engine, ids).top1, accuracy.score_tokens(twin, ids).top1)


def test_greedy_outputs_answer_through_the_chat_template(bf16_engine: LLMEngine) -> None:
    ids = accuracy.chat_ids(bf16_engine, PROMPTS[0])
    assert bf16_engine.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = accuracy.greedy_outputs(bf16_engine, [PROMPTS[0]], n=16)[0]
    assert "Paris" in bf16_engine.tokenizer.decode(out)
