"""The logit shapers and top logprobs (executor/sampler.py) on the built-in model in float32: top logprobs equal to
transformers' full-vocabulary log-softmax position by position; logit_bias that bans and forces tokens;
presence and frequency penalties against a loop written out here from OpenAI's formula; min_p 1 is greedy;
out-of-range values refused by name; and none of these requests speculates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, run_all
from transformers import AutoModelForCausalLM

from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.errors import InvalidParameterError
from loraplane_server.executor.sampler import Sampler, apply_min_p
from loraplane_server.sampling_params import SamplingParams

PROMPT = "The three most famous cities in France are"


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return make_engine(smollm2_dir, num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False)


def generate(engine: LLMEngine, params: SamplingParams, prompt: str = PROMPT):  # noqa: ANN201 - a RequestOutput
    rid = engine.add_request(prompt, params)
    out = run_all(engine, check_errors=True)[rid]
    assert out.finished and out.error is None
    return out


def test_top_logprobs_are_the_full_vocabulary_log_softmax(engine: LLMEngine, smollm2_dir: Path) -> None:
    out = generate(engine, SamplingParams(max_new_tokens=8, top_logprobs=5))
    assert len(out.top_logprobs) == len(out.token_ids) == 8
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    prompt = list(out.prompt_token_ids)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    logp = logits.log_softmax(dim=-1)[len(prompt) - 1 : -1]  # the rows that chose each output token
    for pos, (token, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)):
        ref_lps, ref_ids = logp[pos].topk(5)
        assert [t for t, _ in top] == ref_ids.tolist(), pos
        assert [v for _, v in top] == pytest.approx(ref_lps.tolist(), abs=2e-4), pos
        assert top[0][0] == token  # greedy: the chosen token is the most likely one
        assert lp == pytest.approx(float(logp[pos, token]), abs=2e-4)


def test_logit_bias_bans_and_forces_tokens(engine: LLMEngine) -> None:
    free = generate(engine, SamplingParams(max_new_tokens=4))
    first = free.token_ids[0]
    banned = generate(engine, SamplingParams(max_new_tokens=4, logit_bias={first: -100.0}))
    assert banned.token_ids[0] != first
    assert first not in banned.token_ids
    forced_token = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = generate(engine, SamplingParams(max_new_tokens=3, logit_bias={forced_token: 100.0}, ignore_eos=True))
    assert forced.token_ids == [forced_token] * 3
    # sampling honours it too
    sampled = generate(
        engine, SamplingParams(max_new_tokens=3, temperature=1.0, seed=7, logit_bias={forced_token: 100.0})
    )
    assert sampled.token_ids == [forced_token] * 3


def reference_penalised(logits: torch.Tensor, outputs: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula written out token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for token in set(outputs):
        count = outputs.count(token)
        out[token] -= count * frequency + presence
    return out


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    outputs = [[1, 1, 2, 7], [], [3, 3, 3]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=1.5),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(frequency_penalty=-1.0, top_logprobs=20),
    ]
    sampled = Sampler().sample(logits, params, [None] * 3, [[]] * 3, outputs)
    for i, p in enumerate(params):
        expected = reference_penalised(logits[i], outputs[i], p.presence_penalty, p.frequency_penalty)
        assert int(sampled.token_ids[i]) == int(expected.argmax())
    assert sampled.top is not None
    ids, lps = sampled.top
    ref = reference_penalised(logits[2], outputs[2], 0.0, -1.0).log_softmax(dim=-1)
    assert torch.allclose(lps[2], ref[ids[2]], atol=1e-6)
    assert int(ids[2, 0]) == 3  # a negative frequency penalty favours the repeated token


def test_penalties_change_a_repetitive_generation(engine: LLMEngine) -> None:
    prompt = "one two one two one two one two"
    free = generate(engine, SamplingParams(max_new_tokens=12, ignore_eos=True), prompt)
    penalised = generate(
        engine, SamplingParams(max_new_tokens=12, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0), prompt
    )
    assert penalised.token_ids != free.token_ids
    # a penalty of 2 per use drives repeats down: fewer distinct-token repeats than the free run
    assert len(set(penalised.token_ids)) > len(set(free.token_ids))


def test_min_p_one_keeps_the_top_token_alone(engine: LLMEngine) -> None:
    greedy = generate(engine, SamplingParams(max_new_tokens=6))
    for seed in (1, 2, 3):
        sampled = generate(engine, SamplingParams(max_new_tokens=6, temperature=1.5, seed=seed, min_p=1.0))
        assert sampled.token_ids == greedy.token_ids
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    kept = apply_min_p(logits, torch.tensor([0.3]))
    probs = logits.softmax(-1)[0]
    assert torch.isfinite(kept[0]).tolist() == (probs >= 0.3 * probs.max()).tolist()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("min_p", 1.5),
        ("top_logprobs", 21),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_out_of_range_values_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.param == field


def test_a_bias_outside_the_vocabulary_is_refused_and_the_engine_serves_on(engine: LLMEngine) -> None:
    vocab = engine.inputs.vocab_size
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        engine.add_request(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    assert generate(engine, SamplingParams(max_new_tokens=2)).token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(logit_bias={1: 1.0}),
        SamplingParams(min_p=0.1),
        SamplingParams(top_logprobs=2),
    ],
)
def test_shaped_requests_do_not_speculate(params: SamplingParams) -> None:
    assert not params.speculates
    assert SamplingParams().speculates


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_are_transformers_log_softmax_over_the_prompt(smollm2_dir: Path, chunk: int | None) -> None:
    """Each prompt token's logprob given the ones before it, its rank and the top-3, in one prefill or in chunks of
    8 tokens, and with the prefix cache on: a second request with the same prompt computes them again (a cached
    prefix would have none)."""
    overrides: dict[str, object] = {"num_kv_blocks": 256, "max_model_len": 512, "enable_prefix_caching": True}
    if chunk is not None:
        overrides["max_num_batched_tokens"] = chunk
    engine = make_engine(smollm2_dir, **overrides)
    prompt = PROMPT + " Paris, Lyon and Marseille, with Nice and Toulouse close behind."
    outs = [generate(engine, SamplingParams(max_new_tokens=2, prompt_logprobs=3), prompt) for _ in range(2)]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = list(outs[0].prompt_token_ids)
    with torch.inference_mode():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(dim=-1)
    for out in outs:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - 1
        for pos, (token, lp, rank, top) in enumerate(out.prompt_logprobs, start=1):
            row = logp[pos - 1]
            assert token == ids[pos]
            assert lp == pytest.approx(float(row[token]), abs=2e-4)
            assert rank == int((row > row[token]).sum()) + 1
            ref_lps, ref_ids = row.topk(3)
            assert [t for t, _ in top] == ref_ids.tolist()
            assert [v for _, v in top] == pytest.approx(ref_lps.tolist(), abs=2e-4)
    assert outs[1].num_cached_tokens == 0  # the prefix cache is not read for them


def test_prompt_logprobs_survive_preemption_by_recompute_unchanged(engine: LLMEngine, smollm2_dir: Path) -> None:
    """A KV cache too small for the batch: sequences are preempted and recomputed, and each keeps one entry per
    prompt position, the values of the roomy engine (not recorded twice, not lost)."""
    small = make_engine(smollm2_dir, num_kv_blocks=12, max_model_len=256, enable_prefix_caching=False)
    prompts = [f"{PROMPT} number {i} of twelve, counting slowly:" for i in range(12)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, prompt_logprobs=1)
    ids = [small.add_request(p, params) for p in prompts]
    preempted: set[str] = set()
    done = {}
    while small.has_unfinished:
        done.update((o.request_id, o) for o in small.step() if o.finished)
        preempted |= {rid for rid, seq in small.requests.items() if seq.num_preemptions}
    assert preempted
    for rid, prompt in zip(ids, prompts, strict=True):
        ref = generate(engine, params, prompt)
        got = done[rid].prompt_logprobs
        assert got is not None and ref.prompt_logprobs is not None
        assert [(t, r) for t, _, r, _ in got] == [(t, r) for t, _, r, _ in ref.prompt_logprobs]
        assert [lp for _, lp, _, _ in got] == pytest.approx([lp for _, lp, _, _ in ref.prompt_logprobs], abs=1e-4)
