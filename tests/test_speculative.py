"""Speculative decoding (prompt lookup): proposals, verification, and exactness against plain decoding.

Greedy: token for token equal with speculation on and off (tiny random models and SmolLM2; mixed adapters
and base requests joining at different steps, prefix-cache hits, forced preemption, stops and max_tokens
inside an accepted run; in bf16, parting only at near ties of the fp32 model), with acceptances counted so
the comparison can fail. Sampled: a chi-square test
that the token at one position is distributed as plain sampling's. Blocks and slots back after a soak.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, run_all

from lora_helpers import ADAPTER_SPECS, make_peft_adapter
from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import Sequence
from loraplane_server.spec.policy import NgramIndex, SpecState, cap_proposal


# proposer
def test_ngram_proposes_after_the_most_recent_longest_match() -> None:
    index = NgramIndex()
    # "1 2 3" occurs twice; the later occurrence (followed by 7 8) wins over the earlier (4 5)
    assert index.propose([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3], 2) == [7, 8]
    # no 3-gram or 2-gram match: the 1-gram "5" matches, what followed it is copied
    assert NgramIndex().propose([5, 6, 7, 8, 5], 3) == [6, 7, 8]
    assert NgramIndex().propose([1, 2, 3], 3) == []  # nothing repeats
    # a period shorter than k repeats over itself
    assert NgramIndex().propose([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_ngram_index_is_incremental() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(50)]
    index = NgramIndex()
    for n in range(2, len(tokens)):
        assert index.propose(tokens[:n], 3) == NgramIndex().propose(tokens[:n], 3)


def test_k_adapts_and_caps() -> None:
    state = SpecState(max_k=4)
    assert state.k == 4
    state.adapt(4, 1)
    state.adapt(3, 0)
    assert state.k == 2
    state.adapt(2, 2)
    assert state.k == 3 and (state.num_proposed, state.num_accepted, state.num_steps) == (9, 3, 3)
    for _ in range(5):
        state.adapt(1, 0)
    assert state.k == 1
    # k accepted plus the model's own token fit in max_new_tokens and the context
    assert cap_proposal(4, num_output=5, max_new_tokens=8, length=20, max_model_len=100) == 2
    assert cap_proposal(4, num_output=0, max_new_tokens=8, length=98, max_model_len=100) == 1
    assert cap_proposal(4, num_output=7, max_new_tokens=8, length=20, max_model_len=100) == 0


def test_trim_returns_the_rejected_tail_and_never_caches_it() -> None:
    bm = BlockManager(16, 4)
    seq = Sequence("r", list(range(10)), SamplingParams(max_new_tokens=2))
    bm.allocate(seq, 10, [])
    seq.num_computed_tokens = 9
    bm.allocate(seq, 1 + 6)  # the last token and 6 proposals: positions 9..15, 4 blocks
    assert len(seq.block_table) == 4
    free = bm.num_free_blocks
    seq.num_computed_tokens = 10
    seq.append_token(77)  # one proposal accepted... then the model's own token
    seq.num_computed_tokens, seq.token_ids = 11, seq.token_ids + [78]
    bm.commit(seq)
    bm.trim(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == free + 1
    assert all(bm.blocks[b].block_hash is None for b in seq.block_table[2:])
    bm.free_seq(seq)
    assert bm.num_free_blocks == 16


# engine: greedy
Work = list[tuple[str | None, list[int], SamplingParams, int]]  # (adapter, prompt, params, join step)


def run_work(engine: LLMEngine, work: Work) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's tokens, and the sizes of the groups in which they came (tokens of one step)."""
    rids: list[str | None] = [None] * len(work)
    tokens: dict[str, list[int]] = {}
    groups: dict[str, list[int]] = {}
    step = 0
    while len(tokens) < len(work):
        for i, (adapter, prompt, params, at) in enumerate(work):
            if rids[i] is None and at <= step:
                rids[i] = engine.add_request(prompt, params, adapter_id=adapter)
        seen_this_step: dict[str, int] = {}
        for out in engine.step():
            assert out.error is None, out.error
            seen_this_step[out.request_id] = seen_this_step.get(out.request_id, 0) + len(out.delta_token_ids)
            if out.finished:
                tokens[out.request_id] = out.token_ids
        for rid, n in seen_this_step.items():
            if n:
                groups.setdefault(rid, []).append(n)
        step += 1
        assert step < 5000
    return [tokens[r] for r in rids if r is not None], [groups.get(r, []) for r in rids if r is not None]


def repetitive_prompts(vocab: int, seed: int, n: int) -> list[list[int]]:
    """Prompts that repeat a phrase (so proposals exist), some sharing a long prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(24)]
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        body = phrase * rng.randrange(2, 5) + [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 6))]
        prompts.append(shared + body if i % 3 == 0 else body)
    return prompts


def speculation_counts(engine: LLMEngine) -> tuple[int, int]:
    return engine.speculator.proposed_total, engine.speculator.accepted_total


def own_draft(method: str, model_dir: Path) -> dict[str, object]:
    """For the draft method the model drafting for itself (a draft always right under greedy in fp32), told its
    passes cost nothing so that it always proposes (its own cost model would turn it off: it costs a step)."""
    return {"draft_model": str(model_dir), "draft_cost_ratio": 0.0} if method == "draft" else {}


def drafting(method: str, model_dir: Path) -> dict[str, object]:
    """An engine's speculation settings: off, prompt lookup, or the model drafting for itself."""
    return {"speculative": method, **own_draft(method, model_dir)}


METHODS = pytest.mark.parametrize("method", ["ngram", "draft"])


def compare(
    model_dir: Path,
    work: Work,
    adapters: dict[str, Path] | None = None,
    method: str = "ngram",
    rejections: bool = True,
    **config: object,
) -> tuple[list[list[int]], LLMEngine]:
    """Run `work` with speculation off and on (`method`; a draft_model in config is the plain engine's too,
    unused): equal tokens, blocks and slots back, acceptances seen (and rejections, unless the proposer is
    the model itself). The tokens, and the speculative engine."""
    results = []
    for spec in ("off", method):
        engine = make_engine(model_dir, speculative=spec, **config)
        for name, path in (adapters or {}).items():
            engine.adapters.register(name, str(path))
        free0 = engine.block_manager.num_free_blocks
        results.append((run_work(engine, work), engine))
        assert engine.block_manager.num_free_blocks == free0 and engine.slots.num_busy == 0
    (plain, _), _ = results[0]
    (spec_tokens, groups), engine = results[1]
    if config.get("dtype") == "bfloat16":
        # the CPU kernels' bf16 sums differ in order with the rows in a call (linear_gemm_rows), so the
        # k + 1 verification rows may round a near tie the other way than plain decoding's rows did
        parts_only_at_near_ties(model_dir, adapters or {}, work, plain, spec_tokens)
    else:
        for i, (a, b) in enumerate(zip(plain, spec_tokens, strict=True)):
            assert a == b, f"request {i}: speculative output differs: {a} vs {b}"
    proposed, accepted = speculation_counts(engine)
    assert accepted > 0 and (proposed > accepted or not rejections), (proposed, accepted)
    assert any(g > 1 for gs in groups for g in gs)
    return plain, engine


NEAR_TIE = 0.05  # nats between two tokens' fp32 log-probabilities that bf16 rounding may swap


def parts_only_at_near_ties(
    model_dir: Path, adapters: dict[str, Path], work: Work, plain: list[list[int]], spec: list[list[int]]
) -> None:
    """bf16 speculative against plain tokens: equal, or parting first where the fp32 model (PEFT with
    the request's adapter) scores the two tokens within NEAR_TIE of each other, and at most a third of
    the requests parting at all (a verification bug parts them at once, far from a tie)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_helpers import teacher_forced

    models: dict[str | None, torch.nn.Module] = {}
    parted = 0
    for i, ((adapter, prompt, _, _), a, b) in enumerate(zip(work, plain, spec, strict=True)):
        if a == b:
            continue
        parted += 1
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert at < min(len(a), len(b)), f"request {i}: one output is a prefix of the other: {a} vs {b}"
        if adapter not in models:
            base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
            models[adapter] = base if adapter is None else PeftModel.from_pretrained(base, str(adapters[adapter]))
        (lp_a,), best = teacher_forced(models[adapter], prompt + a[:at], [a[at]])
        (lp_b,), _ = teacher_forced(models[adapter], prompt + a[:at], [b[at]])
        gap = abs(float(lp_a - lp_b))
        assert gap < NEAR_TIE and float(best[0] - max(lp_a, lp_b)) < NEAR_TIE, (
            f"request {i} parts at token {at} ({a[at]} plain, {b[at]} speculative): fp32 log-probabilities "
            f"{float(lp_a):.4f} / {float(lp_b):.4f} (best {float(best[0]):.4f}) are no near tie: {a} vs {b}"
        )
    assert parted * 3 <= len(work), f"{parted} of {len(work)} requests part: {plain} vs {spec}"


def mixed_work(vocab: int, adapters: list[str | None], n: int = 12, seed: int = 5) -> Work:
    rng = random.Random(seed)
    prompts = repetitive_prompts(vocab, seed, n)
    return [
        (adapters[i % len(adapters)], p, SamplingParams(max_new_tokens=rng.randrange(8, 40)), i // 3)
        for i, p in enumerate(prompts)
    ]


def test_tiny_greedy_equal_with_adapters_joins_and_prefix_hits(
    tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    work = mixed_work(512, [*tiny_adapters, None])
    compare(
        tiny_llama_dir,
        work,
        tiny_adapters,
        block_size=4,
        num_kv_blocks=512,
        max_num_batched_tokens=64,
        max_loras=2,
        max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk"),
        speculative_max_step_tokens=64,
    )


def test_tiny_greedy_equal_under_preemption(tiny_qwen2_dir: Path) -> None:
    work = mixed_work(512, [None], n=10, seed=9)
    work = [(a, p, replace(sp, max_new_tokens=32), 0) for a, p, sp, _ in work]
    _, engine = compare(tiny_qwen2_dir, work, block_size=4, num_kv_blocks=48, speculative_max_step_tokens=64)
    assert engine.scheduler.num_preemptions > 0


@METHODS
def test_stop_token_and_max_tokens_inside_an_accepted_run(tiny_llama_dir: Path, method: str) -> None:
    prompts = repetitive_prompts(512, 11, 6)
    work: Work = [(None, p, SamplingParams(max_new_tokens=40), 0) for p in prompts]
    engine = make_engine(tiny_llama_dir, block_size=4, num_kv_blocks=512, **drafting(method, tiny_llama_dir))
    full, groups = run_work(engine, work)
    cut_work: Work = []
    for (adapter, prompt, _, _), tokens, sizes in zip(work, full, groups, strict=True):
        # a token inside a group of several (not its last): the run must end there
        ends = [sum(sizes[: g + 1]) for g in range(len(sizes))]
        inside = [e - sizes[g] + 1 for g, e in enumerate(ends) if sizes[g] > 2]
        if not inside:
            continue
        pos = inside[0]  # index of the group's second token
        cut_work.append((adapter, prompt, SamplingParams(max_new_tokens=pos + 1), 0))
        if tokens[pos] not in tokens[:pos]:
            cut_work.append((adapter, prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[tokens[pos]]), 0))
    assert len(cut_work) >= 3
    draft = own_draft(method, tiny_llama_dir)
    outs, _ = compare(
        tiny_llama_dir, cut_work, method=method, rejections=not draft, block_size=4, num_kv_blocks=512, **draft
    )
    for (_, _, params, _), tokens in zip(cut_work, outs, strict=True):
        if params.stop_token_ids:
            assert tokens[-1] == params.stop_token_ids[0]
        else:
            assert len(tokens) == params.max_new_tokens


def test_request_option_and_the_step_cap(tiny_llama_dir: Path) -> None:
    prompt = repetitive_prompts(512, 3, 1)[0]
    engine = make_engine(tiny_llama_dir, block_size=4, num_kv_blocks=512, speculative_max_step_tokens=8)
    engine.generate([prompt], SamplingParams(max_new_tokens=20))  # the server's default: off
    assert speculation_counts(engine) == (0, 0)
    engine.generate([prompt], SamplingParams(max_new_tokens=20, speculative="ngram"))
    assert speculation_counts(engine)[0] > 0
    # 8 running sequences fill the 8-token cap: nothing proposed
    before = speculation_counts(engine)
    engine.generate([prompt] * 8, SamplingParams(max_new_tokens=20, speculative="ngram", ignore_eos=True))
    assert speculation_counts(engine) == before


@METHODS
def test_soak_with_aborts_returns_every_block_and_slot(
    tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, method: str
) -> None:
    engine = make_engine(
        tiny_llama_dir,
        block_size=4,
        num_kv_blocks=96,
        max_loras=2,
        max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk"),
        speculative_max_step_tokens=64,
        **drafting(method, tiny_llama_dir),
    )
    for name, path in tiny_adapters.items():
        engine.adapters.register(name, str(path))
    free0 = engine.block_manager.num_free_blocks
    rng = random.Random(1)
    names: list[str | None] = [*tiny_adapters, None]
    prompts = repetitive_prompts(512, 21, 40)
    live: list[str] = []
    for step in range(400):
        if prompts and rng.random() < 0.4:
            params = SamplingParams(max_new_tokens=rng.randrange(4, 30), temperature=rng.choice([0.0, 0.9]), seed=step)
            live.append(engine.add_request(prompts.pop(), params, adapter_id=rng.choice(names)))
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            assert out.error is None
    run_all(engine)
    assert engine.speculator.accepted_total > 0
    assert engine.block_manager.num_free_blocks == free0 and engine.slots.num_busy == 0
    assert not engine.requests and not engine.scheduler.running


# engine: sampled
def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test of homogeneity over the categories seen (rare ones pooled)."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    rare = (ca + cb) < 10
    if rare.any():
        ca = torch.cat([ca[~rare], ca[rare].sum()[None]])
        cb = torch.cat([cb[~rare], cb[rare].sum()[None]])
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    dof = len(total) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.isa_agnostic
@METHODS
def test_sampled_token_distribution_matches_plain_sampling(tiny_llama_dir: Path, method: str) -> None:
    """Temperature 0.5, top-k 2 after a prompt ending in the model's own greedy loop: proposals are accepted
    and rejected often (a rejection that forgot to remove the proposal fails this at p ~ 1e-8)."""
    rng = random.Random(0)
    phrase = [rng.randrange(3, 500) for _ in range(8)]
    greedy = make_engine(tiny_llama_dir).generate([phrase * 4], SamplingParams(max_new_tokens=20))[0].token_ids
    prompt = phrase * 4 + greedy
    position = 6  # the 7th generated token: reached through accepted and rejected proposals
    num = 600
    draws: dict[str, list[int]] = {}
    for spec in ("off", method):
        engine = make_engine(
            tiny_llama_dir,
            **drafting(spec, tiny_llama_dir),
            max_num_seqs=num,
            max_num_batched_tokens=8192,
            num_kv_blocks=4096,
            block_size=4,
            speculative_max_step_tokens=8192,
        )
        seed0 = 1000 if spec == "off" else 100_000  # independent samples
        params = [SamplingParams(max_new_tokens=8, temperature=0.5, top_k=2, seed=seed0 + i) for i in range(num)]
        outs = engine.generate([prompt] * num, params)
        draws[spec] = [o.token_ids[position] for o in outs]
        if spec == method:
            proposed, accepted = speculation_counts(engine)
            assert 0.05 * proposed < accepted < 0.9 * proposed, (proposed, accepted)
            again = engine.generate([prompt] * 4, params[:4])  # a seed replays
            assert [o.token_ids for o in again] == [o.token_ids for o in outs[:4]]
    assert len(set(draws["off"])) > 2
    p = chi_square_p(draws["off"], draws[method])
    assert p > 1e-3, p


# the built-in model, and the bf16 kernels
GROUNDED = (
    "The river town of Halden keeps its market on the north bank every Tuesday. Farmers bring apples, pears and "
    "goat cheese; the baker sells rye loaves until noon. In winter the market moves into the old grain hall."
)
SMOL_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{GROUNDED}\n\nRepeated text:\n",
    f"Copy this paragraph, replacing 'Tuesday' with 'Friday':\n\n{GROUNDED}\n\nNew paragraph:\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# the same functions with type hints\n",
]


@pytest.mark.isa_agnostic
@METHODS
def test_smollm2_greedy_equal_with_an_adapter_and_a_stop_string_inside_a_run(
    smollm2_dir: Path, tmp_path: Path, method: str
) -> None:
    """The built-in model with its tokenizer (for the draft method, drafting for itself: the tokenizers checked,
    base requests' runs all accepted)."""
    adapter = make_peft_adapter(smollm2_dir, tmp_path / "a", seed=0, b_scale=0.05, **ADAPTER_SPECS["qv-r4"])
    engine = make_engine(smollm2_dir, max_model_len=512, **drafting(method, smollm2_dir))
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in SMOL_PROMPTS]
    (full,), (groups,) = run_work(engine, [(None, ids[0], SamplingParams(max_new_tokens=24), 0)])
    # a stop string inside a run: the text of a group's second token that the output had not shown before
    ends = [sum(groups[: g + 1]) for g in range(len(groups))]
    stop = next(
        text
        for g, end in enumerate(ends)
        if groups[g] > 2
        and len(text := engine.decode([full[end - groups[g] + 1]]).strip()) > 2
        and text not in engine.decode(full[: end - groups[g] + 1])
    )
    work: Work = [
        (None, ids[0], SamplingParams(max_new_tokens=24, stop=[stop]), 0),
        ("a", ids[1], SamplingParams(max_new_tokens=24), 1),
        (None, ids[2], SamplingParams(max_new_tokens=24), 2),
        ("a", ids[1], SamplingParams(max_new_tokens=12), 3),  # a prefix-cache hit
    ]
    draft = own_draft(method, smollm2_dir)
    outs, _ = compare(
        smollm2_dir,
        work,
        {"a": adapter},
        method=method,
        rejections=not draft,
        disk_cache_dir=str(tmp_path / "disk"),
        max_model_len=512,
        **draft,
    )
    assert engine.decode(outs[0]).endswith(stop) and len(outs[0]) < len(full)


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize("fuse_layers", [True, False], ids=["fused", "layers"])
@METHODS
def test_bf16_kernels_greedy_equal(
    tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, fuse_layers: bool, method: str
) -> None:
    """The verification rows through the CPU kernels (prefill-chunk attention, the last layer on k + 1 logits
    rows a sequence, BGMV per row): plain decoding's tokens, or a first parting at a near tie of the fp32
    model (the kernels' bf16 sums take another order at other row counts; this tiny model's flat
    distributions have such ties)."""
    work = mixed_work(512, [*tiny_adapters, None], n=9, seed=13)
    compare(
        tiny_llama_dir,
        work,
        tiny_adapters,
        dtype="bfloat16",
        fuse_layers=fuse_layers,
        block_size=16,
        num_kv_blocks=256,
        max_loras=2,
        max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk"),
        speculative_max_step_tokens=64,
        method=method,
        **own_draft(method, tiny_llama_dir),
    )


def test_nonfinite_rows_drop_their_whole_sequence() -> None:
    """A speculative sequence with a NaN in any of its k + 1 rows is set aside whole; the others keep their rows."""
    from types import SimpleNamespace

    from loraplane_server.executor.model_runner import ModelRunner

    plain, spec, other = (Sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(3))
    spec.spec = SpecState(max_k=4, proposed=[5, 6])
    for i, seq in enumerate((plain, spec, other)):
        seq.block_table = [i]
    logits = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)  # rows: plain, spec x 3, other
    logits[2, 1] = float("nan")
    runner = SimpleNamespace(kv_pools=[torch.ones(1, 2, 3, 1)], window_layers=[], nonfinite=[])
    runner._set_aside = lambda seq: ModelRunner._set_aside(runner, seq)  # type: ignore[arg-type]
    kept, seqs = ModelRunner._drop_nonfinite(runner, logits, [plain, spec, other])  # type: ignore[arg-type]
    assert seqs == [plain, other] and runner.nonfinite == [spec]
    assert torch.equal(kept, logits[[0, 4]])
    cache = runner.kv_pools[0]
    assert cache[:, :, 1].eq(0).all() and cache[:, :, [0, 2]].eq(1).all()
