"""Greedy output inside one mixed batch (several adapters plus base-model requests) equals PEFT's
output for each adapter alone, token for token, in fp32: on a tiny random model and on SmolLM2."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine

from lora_helpers import ADAPTER_SPECS, make_peft_adapter, peft_greedy
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.lora.backends import TorchBackend
from loraplane_server.sampling_params import SamplingParams


def run_mixed(engine: LLMEngine, work: list[tuple[str | None, list[int], int, int]]) -> list[list[int]]:
    """work: (adapter, prompt, max_new, join_step); returns each request's tokens in order."""
    rids: list[str | None] = [None] * len(work)
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(work):
        for i, (adapter, prompt, n, at) in enumerate(work):
            if rids[i] is None and at <= step:
                rids[i] = engine.add_request(prompt, SamplingParams(max_new_tokens=n), adapter_id=adapter)
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
        assert step < 5000
    return [done[r] for r in rids if r is not None]


def check_against_peft(base_dir: Path, tmp: Path, vocab: int, max_loras: int, b_scale: float) -> LLMEngine:
    adapters = {
        name: make_peft_adapter(base_dir, tmp / name, seed=i, b_scale=b_scale, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    rng = random.Random(3)
    names: list[str | None] = [*adapters, None]
    work = []
    for i in range(15):
        adapter = names[i % len(names)]
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))]
        work.append((adapter, prompt, rng.randrange(4, 14), i // 3))
    engine = make_engine(
        base_dir,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        max_loras=max_loras,
        max_lora_rank=16,
        disk_cache_dir=str(tmp / "disk-cache"),
    )
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
    free0 = engine.block_manager.num_free_blocks
    ours = run_mixed(engine, work)
    for name in names:
        rows = [i for i, w in enumerate(work) if w[0] == name]
        ref = peft_greedy(
            base_dir, adapters[name] if name else None, [work[i][1] for i in rows], [work[i][2] for i in rows]
        )
        assert [ours[i] for i in rows] == ref, f"adapter {name} differs from PEFT"
        if name is not None:  # the adapter really changes the output
            plain = peft_greedy(base_dir, None, [work[i][1] for i in rows], [work[i][2] for i in rows])
            assert plain != ref, f"adapter {name} has no visible effect"
    assert engine.block_manager.num_free_blocks == free0
    assert engine.slots.num_busy == 0
    return engine


@pytest.mark.parametrize(("max_loras", "dense_max"), [(4, 16), (2, 16), (4, 0)], ids=["dense", "dense-2", "bgmv"])
def test_tiny_mixed_batch_matches_peft(
    tiny_llama_dir: Path, tmp_path: Path, max_loras: int, dense_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TorchBackend, "DENSE_MAX_SLOTS", dense_max)  # both decode paths
    check_against_peft(tiny_llama_dir, tmp_path, 512, max_loras, b_scale=1.0)


@pytest.mark.slow
def test_smollm2_mixed_batch_matches_peft(smollm2_dir: Path, tmp_path: Path) -> None:
    check_against_peft(smollm2_dir, tmp_path, 49152, 4, b_scale=1.0)


def test_one_adapter_alone_matches_peft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Every decode row on one adapter (a lone request or one hot adapter) takes the single-slot path."""
    name, spec = next(iter(ADAPTER_SPECS.items()))
    path = make_peft_adapter(tiny_llama_dir, tmp_path / name, seed=0, b_scale=1.0, **spec)
    engine = make_engine(tiny_llama_dir, block_size=4, num_kv_blocks=64, max_lora_rank=16)
    engine.adapters.register(name, str(path))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 19)]
    work = [(name, prompts[0], 9, 0), (name, prompts[1], 6, 0)]
    assert run_mixed(engine, work) == peft_greedy(tiny_llama_dir, path, prompts, [9, 6])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_layer_runs_on_the_logits_rows_alone(tiny_llama_dir: Path, tmp_path: Path, dtype: str) -> None:
    """In a step with prefill rows that sample nothing, the last layer's o projection and MLP (LoRA
    included) take the logits rows alone, and the logits equal those of the whole step's rows."""
    adapters = {
        name: make_peft_adapter(tiny_llama_dir, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    engine = make_engine(
        tiny_llama_dir,
        dtype=dtype,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=48,
        max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk-cache"),
    )
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
    model = engine.runner.model
    mlp_rows: list[int] = []
    model.layers[-1].mlp.register_forward_pre_hook(lambda _m, args: mlp_rows.append(args[0].shape[0]))
    forward = model.forward
    checked: list[int] = []

    def both(input_ids, kv_caches, batch):  # noqa: ANN001, ANN202
        logits = forward(input_ids, kv_caches, batch)
        if batch.prunes_last_layer:
            assert mlp_rows[-1] == len(batch.logits_indices) < len(input_ids)
            full = forward(input_ids, kv_caches, replace(batch, logits_indices=None, logits_lora=None))
            torch.testing.assert_close(logits, full[batch.logits_indices], atol=2e-2, rtol=2e-2)
            assert (logits.argmax(-1) == full[batch.logits_indices].argmax(-1)).float().mean() > 0.9
            checked.append(len(input_ids))
        return logits

    model.forward = both
    rng = random.Random(7)
    names: list[str | None] = [*adapters, None]
    work = [(names[i % 5], [rng.randrange(3, 512) for _ in range(rng.randrange(5, 30))], 5, i // 4) for i in range(10)]
    run_mixed(engine, work)
    assert len(checked) >= 3, "some steps prefilled rows that sample nothing"
