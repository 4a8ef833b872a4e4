"""Speculative decoding with a draft model (draft.py): exact under greedy against plain decoding, the draft's
K/V right (a draft that is the model itself has every proposal accepted), catch-ups spread over steps,
the KV pool sized for both models, and clear refusals (no draft, another tokenizer).

The prompt-lookup tests in test_speculative.py that take a `method` run the draft too (stops and
max_tokens inside a run, a soak with aborts, the sampled distribution, the bf16 kernels, SmolLM2 with an
adapter and a stop string).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tiny
from engine_helpers import make_engine
from safetensors.torch import load_file, save_file
from test_speculative import compare, mixed_work, repetitive_prompts, run_work

from loraplane_server.config import EngineConfig
from loraplane_server.errors import InvalidRequestError
from loraplane_server.executor.model_runner import kv_block_bytes
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.spec.draft import DraftModelError, check_vocabulary
from loraplane_server.spec.policy import DraftGate, DraftPolicy, draft_k, expected_accepted

# draft_cost_ratio 0: the draft proposes whenever it can (its cost model is tested on its own below)
TINY = dict(
    block_size=4, num_kv_blocks=512, max_num_batched_tokens=64, speculative_max_step_tokens=64, draft_cost_ratio=0.0
)


def perturbed_copy(model_dir: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """The model with Gaussian noise (noise x each tensor's std) on every weight: a draft that agrees with it
    often but not always."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "config.json", out / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = t + torch.randn(t.shape, generator=gen) * t.std() * noise
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def near_draft(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tiny_llama_dir, tmp_path_factory.mktemp("near-draft"), noise=0.1)


def test_the_model_as_its_own_draft_has_every_proposal_accepted(tiny_llama_dir: Path) -> None:
    """fp32, no adapter: the draft computes what the model does, so a wrong K/V (a position skipped, a
    rejected proposal's left in place, the catch-up off by one) shows up as a rejection."""
    work = mixed_work(512, [None], n=9, seed=3)
    _, engine = compare(tiny_llama_dir, work, method="draft", rejections=False, draft_model=str(tiny_llama_dir), **TINY)
    assert (
        engine.speculator.proposed_total > 100 and engine.speculator.accepted_total == engine.speculator.proposed_total
    )
    assert engine.speculator.draft is not None and engine.speculator.draft.num_passes > 0


def test_greedy_equal_with_adapters_joins_and_prefix_hits(
    tiny_llama_dir: Path, near_draft: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The draft runs without the adapters; each sequence's verification applies its own."""
    work = mixed_work(512, [*tiny_adapters, None])
    _, engine = compare(
        tiny_llama_dir,
        work,
        tiny_adapters,
        method="draft",
        draft_model=str(near_draft),
        max_loras=2,
        max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk"),
        **TINY,
    )
    assert engine.block_manager.num_prefix_hits > 0


def test_a_draft_of_another_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A Qwen2 draft (tied embeddings, q/k/v biases) with the Llama model's vocabulary: an unrelated random
    model, so nearly every proposal is rejected, and the output is still plain decoding's."""
    draft = save_tiny(tmp_path / "qwen2-draft", "qwen2", seed=7)
    work = mixed_work(512, [None], n=6, seed=4)
    results = []
    for spec in ("off", "draft"):
        engine = make_engine(tiny_llama_dir, speculative=spec, draft_model=str(draft), **TINY)
        results.append(run_work(engine, work)[0])
    assert results[0] == results[1]
    assert engine.speculator.proposed_total > 50 and "qwen2-draft" in engine.describe()


def test_greedy_equal_under_preemption(tiny_llama_dir: Path, near_draft: Path) -> None:
    """Preempted sequences lose their blocks, the draft's K/V with them: it starts over from the prompt."""
    work = mixed_work(512, [None], n=10, seed=9)
    work = [(a, p, SamplingParams(max_new_tokens=32), 0) for a, p, _, _ in work]
    config = {**TINY, "num_kv_blocks": 48}
    _, engine = compare(tiny_llama_dir, work, method="draft", draft_model=str(near_draft), **config)
    assert engine.scheduler.num_preemptions > 0


def test_a_long_catch_up_is_spread_over_steps(tiny_llama_dir: Path) -> None:
    """A prompt longer than a step's tokens: the draft catches up in step-sized chunks without proposing,
    then proposes (the model as its own draft: every proposal accepted, so no chunk was lost)."""
    prompt = repetitive_prompts(512, 2, 1)[0] * 6
    assert len(prompt) > 3 * 16
    config = {**TINY, "max_num_batched_tokens": 16}
    plain = make_engine(tiny_llama_dir, **config).generate([prompt], SamplingParams(max_new_tokens=24))[0]
    engine = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(tiny_llama_dir), **config)
    spec = engine.generate([prompt], SamplingParams(max_new_tokens=24))[0]
    assert spec.token_ids == plain.token_ids
    assert engine.speculator.draft is not None and engine.speculator.draft.num_tokens >= len(prompt)
    assert engine.speculator.accepted_total == engine.speculator.proposed_total > 0
    # the first proposal waited for the catch-up: fewer verified steps than decode steps
    assert spec.num_spec_steps < 24


def test_the_kv_pool_holds_both_models(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """kv_cache_bytes buys blocks that hold the model's and the draft's K/V; the draft's tensors use the
    same block ids."""
    draft = save_tiny(tmp_path / "deep-draft", "llama", num_hidden_layers=5, seed=3)
    budget = 1 << 20
    plain = make_engine(tiny_llama_dir, kv_cache_bytes=budget, block_size=4)
    engine = make_engine(tiny_llama_dir, kv_cache_bytes=budget, block_size=4, draft_model=str(draft))
    assert engine.speculator.draft is not None
    per_block = kv_block_bytes(engine.runner.model.args, 4, torch.float32)
    draft_block = kv_block_bytes(engine.speculator.draft.model.args, 4, torch.float32)
    assert plain.block_manager.num_blocks == budget // per_block
    assert engine.block_manager.num_blocks == budget // (per_block + draft_block)
    assert (
        engine.speculator.draft.kv_caches.shape[2]
        == engine.runner.kv_caches.shape[2]
        == engine.block_manager.num_blocks
    )


def test_refusals(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative="draft")
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="--draft-model") as err:
        engine.add_request([1, 2, 3], SamplingParams(speculative="draft"))
    assert err.value.param == "speculative"
    other = save_tiny(tmp_path / "other-vocab", "llama", vocab_size=600)
    with pytest.raises(DraftModelError, match="600 tokens"):
        make_engine(tiny_llama_dir, draft_model=str(other))


def test_vocabulary_check() -> None:
    args = SimpleNamespace(vocab_size=8)
    vocab = {f"t{i}": i for i in range(6)}
    tok = SimpleNamespace(get_vocab=lambda: dict(vocab))
    check_vocabulary(tok, tok, args, SimpleNamespace(vocab_size=6))  # type: ignore[arg-type]  # padding may differ
    swapped = SimpleNamespace(get_vocab=lambda: {**vocab, "t1": 2, "t2": 1})
    with pytest.raises(DraftModelError, match="'t1' is id 1 in the model's, 2 in the draft's"):
        check_vocabulary(tok, swapped, args, args)  # type: ignore[arg-type]
    with pytest.raises(DraftModelError, match="embedding has 4 rows"):
        check_vocabulary(tok, tok, args, SimpleNamespace(vocab_size=4))  # type: ignore[arg-type]


# when the draft pays
def test_draft_k_weighs_accepted_tokens_against_the_passes() -> None:
    assert expected_accepted(0.5, 3) == 0.5 + 0.25 + 0.125
    # a draft as dear as the model never pays; a free one proposes its full k
    assert draft_k([(0.99, 4)], num_rows=1, cost_ratio=1.0) == 0
    assert draft_k([(0.5, 4)], num_rows=1, cost_ratio=0.0) == 4
    # the model's own int8 copy (~0.7 a pass, ~94% accepted): a few tokens, not the most it may
    assert draft_k([(0.94, 8)], num_rows=1, cost_ratio=0.7) == 3
    # the same draft for 2 of 8 sequences: the other 6 would wait for it for nothing
    assert draft_k([(0.94, 4)] * 2, num_rows=8, cost_ratio=0.7) == 0
    assert draft_k([(0.94, 4)] * 8, num_rows=8, cost_ratio=0.7) == 3
    assert draft_k([], num_rows=4, cost_ratio=0.0) == 0


def test_a_draft_as_dear_as_the_model_never_proposes(tiny_llama_dir: Path) -> None:
    """A draft pass that costs a plain step (draft_cost_ratio 1, as the model drafting for itself would
    measure on a model large enough that its step is the work) never pays, however right it is."""
    config = {**TINY, "draft_cost_ratio": 1.0}
    engine = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(tiny_llama_dir), **config)
    engine.generate(repetitive_prompts(512, 1, 3), SamplingParams(max_new_tokens=16))
    assert engine.speculator.proposed_total == 0 and engine.speculator.draft_policy.skipped > 0


def test_a_cheap_draft_that_is_always_wrong_switches_itself_off(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A small random draft is cheap (it proposes at first) and wrong: the engine's acceptance estimate falls
    until its proposals no longer pay, then it stops proposing. The cost is fixed at a quarter of a step (cheap:
    its weights are ~12% of the model's; 0.2 to 0.3 all pass): measured, the timing gate may switch the draft off
    first on a loaded machine, leaving too few verified runs for the estimate to fall (CI saw 0.73 after 4
    prompts; the gate has its own tests)."""
    draft = save_tiny(tmp_path / "small", "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, seed=5)
    config = {**TINY, "draft_cost_ratio": 0.25}
    engine = make_engine(tiny_llama_dir, speculative="draft", draft_model=str(draft), **config)
    assert engine.speculator.draft_policy is not None and engine.speculator.draft_policy.bytes_ratio < 1 / 3
    prompts = repetitive_prompts(512, 6, 8)
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=32))
    early = engine.speculator.proposed_total
    assert early > 0 and engine.speculator.draft_policy.acceptance < 0.5
    engine.generate(prompts[4:], SamplingParams(max_new_tokens=32))
    assert engine.speculator.proposed_total - early < early / 4 and engine.speculator.draft_policy.skipped > 0


def test_the_gate_takes_the_faster_side_and_retries_the_other_less_often() -> None:
    gate = DraftGate(explore=4, burst=2, max_explore=16)
    rows = 3
    choices = []
    for _ in range(60):
        on = gate.allow(rows)
        choices.append(on)
        gate.record(rows, on, tokens=3, seconds=0.02 if on else 0.01)  # drafting: half the tokens/s
    assert choices[:4] == [True, True, False, False]  # each side a burst first, the draft's first
    assert not gate.retrying(rows)
    retries = [i for i in range(4, 60) if choices[i]]
    assert 4 <= len(retries) <= 12  # bursts of 2, further and further apart
    gaps = [b - a for a, b in zip(retries, retries[1:], strict=False) if b - a > 1]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    # the draft gets faster: after its next retry it wins and runs from then on
    for _ in range(40):
        on = gate.allow(rows)
        gate.record(rows, on, tokens=3, seconds=0.005 if on else 0.01)
    assert all(gate.allow(rows) for _ in range(3))
    assert gate.bucket(3) == gate.bucket(2) != gate.bucket(4)  # sizes in powers of two


def test_the_policy_plans_a_step() -> None:
    fixed = DraftPolicy(fixed_cost=0.0, bytes_ratio=0.5, max_batched_tokens=2048, max_step_tokens=32)
    assert fixed.plan(num_running=4, num_drafting=4, spare=28) == (7, 2048, False)  # the spare shared evenly
    assert fixed.plan(num_running=4, num_drafting=0, spare=28) == (0, 0, False)
    assert fixed.gated is None and fixed.cost(pass_seconds=0.004) == 0.0
    measured = DraftPolicy(fixed_cost=None, bytes_ratio=0.5, max_batched_tokens=2048, max_step_tokens=32)
    assert measured.cost(None) == 0.5  # the bytes until both passes are measured
    measured.record_step(decode_seconds=0.010, drafted=False, tokens=1, step_seconds=0.010)
    assert measured.cost(pass_seconds=0.004) == pytest.approx(0.4)
    assert measured.plan(num_running=1, num_drafting=1, spare=31) == (31, 2048, False)  # the draft's first try
    assert measured.gated == 1
    measured.record_step(decode_seconds=0.010, drafted=True, tokens=5, step_seconds=0.020)
    assert measured.gate.size(1).rates[1] == 250.0
    measured.record_run(proposed=4, accepted=0)
    assert measured.acceptance < 0.9


def test_a_step_without_speculation_is_not_the_gates_measurement(tiny_llama_dir: Path) -> None:
    """A decode step in which nobody speculates (the draft's requests done, a plain one left) records nothing
    under the gate's last decision."""
    config = {**TINY, "draft_cost_ratio": None}
    engine = make_engine(tiny_llama_dir, speculative="off", draft_model=str(tiny_llama_dir), **config)
    assert engine.speculator.draft_policy is not None
    prompt = repetitive_prompts(512, 7, 1)[0]
    engine.generate([prompt], SamplingParams(max_new_tokens=12, speculative="draft"))
    rates = {b: list(g.rates) for b, g in engine.speculator.draft_policy.gate.sizes.items()}
    assert rates  # the draft's request was gated
    engine.generate([prompt], SamplingParams(max_new_tokens=12))
    assert {b: g.rates for b, g in engine.speculator.draft_policy.gate.sizes.items()} == rates
