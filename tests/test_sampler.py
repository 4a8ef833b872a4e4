"""Sampler: greedy, top-k, top-p, repetition penalty, per-request seeds, distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from loraplane_server.executor.sampler import Sampler, apply_repetition_penalty, make_generator
from loraplane_server.sampling_params import SamplingParams

CPU = torch.device("cpu")


def run(logits, params, generators=None, seen=None):
    batch = logits.shape[0]
    generators = generators if generators is not None else [None] * batch
    seen = seen if seen is not None else [[] for _ in range(batch)]
    return Sampler()(logits, params, generators, seen)


def repeat(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [params] * n


# greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_with_logprobs(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 50).to(dtype)
    tokens, logprobs = run(logits, repeat(SamplingParams(logprobs=True), 6))
    expected = logits.float().argmax(-1)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens, expected)
    ref = logits.float().log_softmax(-1).gather(1, expected[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, ref)


def test_top_k_one_and_tiny_top_p_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(64, 100)
    expected = logits.argmax(-1)
    tokens_k, _ = run(logits, repeat(SamplingParams(temperature=1.5, top_k=1), 64))
    tokens_p, _ = run(logits, repeat(SamplingParams(temperature=1.5, top_p=1e-6), 64))
    assert torch.equal(tokens_k, expected)
    assert torch.equal(tokens_p, expected)


def test_greedy_rows_stay_argmax_in_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(8, 40)
    params = [SamplingParams(logprobs=True) if i % 2 == 0 else SamplingParams(temperature=2.0) for i in range(8)]
    params[1] = SamplingParams(temperature=2.0, logprobs=True)
    tokens, logprobs = run(logits, params)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    ref = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    asked = torch.tensor([p.logprobs for p in params])
    torch.testing.assert_close(logprobs[asked], ref[asked])  # logprobs ignore the temperature
    assert bool(logprobs[~asked].isnan().all())  # rows that did not ask get none computed


def test_no_logprobs_computed_when_no_row_asks():
    logits = torch.randn(4, 30)
    tokens, logprobs = run(logits, repeat(SamplingParams(), 4))
    assert torch.equal(tokens, logits.argmax(-1)) and bool(logprobs.isnan().all())


# top-k
def test_top_k_restricts_to_k_largest():
    torch.manual_seed(3)
    row = torch.randn(1, 30)
    n = 2000
    tokens, _ = run(row.expand(n, -1), repeat(SamplingParams(temperature=3.0, top_k=4), n))
    allowed = set(row[0].topk(4).indices.tolist())
    assert set(tokens.tolist()) == allowed


# top-p
def test_top_p_restricts_to_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    row = probs.log()[None, :]
    n = 2000
    torch.manual_seed(4)
    tokens, _ = run(row.expand(n, -1), repeat(SamplingParams(temperature=1.0, top_p=0.7), n))
    assert set(tokens.tolist()) == {1, 3}  # 0.5 + 0.3 >= 0.7; 0.5 alone is not
    tokens, _ = run(row.expand(n, -1), repeat(SamplingParams(temperature=1.0, top_p=0.85), n))
    assert set(tokens.tolist()) == {1, 3, 2}


# repetition penalty
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    torch.manual_seed(5)
    logits = torch.randn(3, 64)
    seen = torch.randint(0, 64, (3, 12))
    ref = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    params = repeat(SamplingParams(repetition_penalty=penalty, logprobs=True), 3)
    out = apply_repetition_penalty(logits, params, seen.tolist())
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    tokens, logprobs = run(logits, params, seen=seen.tolist())
    assert torch.equal(tokens, ref.argmax(-1))
    torch.testing.assert_close(logprobs, ref.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


def test_repetition_penalty_only_on_its_rows_with_ragged_seen():
    torch.manual_seed(6)
    logits = torch.randn(3, 20)
    original = logits.clone()
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0),
    ]
    seen = [[1, 2, 2, 25], [1, 2, 3], [7]]  # 25 is past the vocab: ignored, as in transformers
    out = apply_repetition_penalty(logits, params, seen)
    assert torch.equal(logits, original)  # input untouched
    for i, ids in [(0, [1, 2]), (2, [7])]:
        ref = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([ids]), logits[i : i + 1].clone())
        assert torch.equal(out[i : i + 1], ref)
    assert torch.equal(out[1], logits[1])


# per-request seed
def _seeded_sequence(steps, position, batch, seed_params):
    """Tokens the seeded row picks over `steps` steps, placed at `position` in a batch of `batch`."""
    gen = make_generator(seed_params.seed, CPU)
    others = torch.Generator().manual_seed(1000 + position)  # different neighbours per placement
    tokens = []
    for step in range(steps):
        target = torch.Generator().manual_seed(step)
        row = torch.randn(1, 100, generator=target) * 3
        logits = torch.randn(batch, 100, generator=others) * 3
        logits[position] = row[0]
        params, gens, seen = [], [], []
        for i in range(batch):
            if i == position:
                params.append(seed_params), gens.append(gen), seen.append([3, 5, 7])
                continue
            params.append(
                SamplingParams(
                    temperature=[0.0, 0.5, 1.0, 2.0][i % 4],
                    top_k=[0, 5, 50][i % 3],
                    top_p=[1.0, 0.9][i % 2],
                    repetition_penalty=[1.0, 1.2][i % 2],
                    seed=i if i % 3 == 0 else None,
                )
            )
            gens.append(make_generator(params[-1].seed, CPU))
            seen.append(list(range(i)))
        torch.manual_seed(step * 7 + position)  # global RNG differs per placement
        out, _ = Sampler()(logits, params, gens, seen)
        tokens.append(int(out[position]))
    return tokens


def test_seeded_row_is_independent_of_batch():
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=1234)
    alone = _seeded_sequence(20, 0, 1, params)
    assert len(set(alone)) > 5  # actually sampling, not collapsing to argmax
    for position in (0, 7, 15):
        assert _seeded_sequence(20, position, 16, params) == alone
    other_seed = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=99)
    assert _seeded_sequence(20, 0, 1, other_seed) != alone


def test_make_generator_none_without_seed():
    assert make_generator(None, CPU) is None
    assert isinstance(make_generator(0, CPU), torch.Generator)


# distribution
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_samples_match_softmax_of_scaled_logits(seeded, temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    n = 4000
    torch.manual_seed(7)
    generators = [make_generator(s, CPU) for s in range(n)] if seeded else None
    tokens, _ = run(logits.expand(n, -1), repeat(SamplingParams(temperature=temperature), n), generators)
    counts = torch.bincount(tokens, minlength=8).float()
    expected = (logits[0] / temperature).softmax(-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
