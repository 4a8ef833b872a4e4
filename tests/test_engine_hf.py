"""Greedy output equals Hugging Face transformers generate(), token for token, in fp32.

Requests join a running batch at different steps, share prefixes (prefix-cache hits), and the KV
pool is small enough to force preemption; the token budget forces chunked prefill.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine

from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.kernels.triton_attention import triton_available
from loraplane_server.sampling_params import SamplingParams


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for ids, n in zip(prompts, max_new, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        outs.append(out[0, len(ids) :].tolist())
    return outs


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], max_new: list[int], join_step: list[int]
) -> list[list[int]]:
    """Add prompt i once engine.step() has run join_step[i] times; run everything to the end."""
    rids: list[str | None] = [None] * len(prompts)
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(join_step):
            if rids[i] is None and at <= step:
                rids[i] = engine.add_request(prompts[i], SamplingParams(max_new_tokens=max_new[i]))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
        assert step < 10_000
    return [done[r] for r in rids if r is not None]


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    lengths = [3, 17, 33, 64, 90, 8, 120, 50]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(vocab) for _ in range(k)] for k in (5, 21, 2)]  # prefix hits
    prompts.append(list(prompts[3]))  # an identical prompt
    return prompts


@pytest.mark.parametrize("attention", ["cpu_kernel", "torch"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("num_blocks", [256, 40])
def test_tiny_models_match_hf(
    kind: str, num_blocks: int, attention: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    model_dir = tiny_llama_dir if kind == "llama" else tiny_qwen2_dir
    prompts = make_prompts(512, seed=7)
    max_new = [20, 5, 40, 12, 30, 25, 9, 16, 18, 22, 11, 14]
    join = [0, 0, 1, 2, 2, 5, 6, 9, 12, 13, 20, 30]
    engine = make_engine(
        model_dir,
        block_size=4,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        attention_backend=attention,
    )
    assert engine.attention_backend == attention
    free0 = engine.block_manager.num_free_blocks
    ours = run_staggered(engine, prompts, max_new, join)
    assert ours == hf_greedy(model_dir, prompts, max_new)
    assert engine.block_manager.num_free_blocks == free0
    assert engine.block_manager.num_prefix_hits > 0
    if num_blocks == 40:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1")
def test_triton_decode_attention_matches_hf(tiny_qwen2_dir: Path) -> None:
    """The CUDA decode-attention kernel, run by the Triton interpreter on CPU tensors, inside the engine."""
    prompts = make_prompts(512, seed=11)[:6]
    max_new, join = [12, 5, 9, 7, 10, 6], [0, 0, 1, 3, 4, 6]
    engine = make_engine(
        tiny_qwen2_dir,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=48,
        max_num_seqs=4,
        attention_backend="triton",
    )
    assert engine.attention_backend == "triton"
    free0 = engine.block_manager.num_free_blocks
    assert run_staggered(engine, prompts, max_new, join) == hf_greedy(tiny_qwen2_dir, prompts, max_new)
    assert engine.block_manager.num_free_blocks == free0


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2_dir: Path) -> None:
    engine = make_engine(
        smollm2_dir,
        block_size=16,
        num_kv_blocks=10,
        max_num_batched_tokens=96,
        max_num_seqs=8,
    )
    assert engine.attention_backend == "cpu_kernel"  # auto on this CPU; the torch path is covered above
    tok = engine.tokenizer
    system = "You are a helpful assistant who answers briefly and accurately. "
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        system + "What is 12 times 12?",
        system + "Name three primary colors.",
        "def fibonacci(n):\n    ",
        "In 1969, the first humans landed on",
        "Translate to French: Good morning, how are you today? I hope the weather is nice.",
        "List the planets of the solar system in order from the sun, starting with Mercury and ending with",
        system + "What is 12 times 12?",
    ]
    prompts = [tok.encode(t) for t in texts]
    max_new = [24, 30, 20, 28, 32, 16, 26, 30, 20]
    join = [0, 0, 1, 2, 3, 3, 5, 8, 40]
    free0 = engine.block_manager.num_free_blocks
    ours = run_staggered(engine, prompts, max_new, join)
    theirs = hf_greedy(smollm2_dir, prompts, max_new)
    assert ours == theirs
    assert "Paris" in tok.decode(ours[0])
    assert engine.block_manager.num_free_blocks == free0
    assert engine.block_manager.num_prefix_hits > 0
    assert engine.scheduler.num_preemptions > 0
