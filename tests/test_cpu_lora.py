"""The CPU BGMV kernel (csrc/lora_cpu.cpp) against the LoRA math in fp32, and a bf16 engine serving
many adapters at once, scored against PEFT in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import ADAPTER_SPECS, make_peft_adapter, teacher_forced
from loraplane_server.config import EngineConfig
from loraplane_server.engine import LLMEngine
from loraplane_server.layers import cpu_kernels
from loraplane_server.lora.batch import LoRABatch
from loraplane_server.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load() or "avx512_bf16" not in cpu_kernels._cpu_flags(),
    reason=f"needs the CPU kernels on an AVX512-BF16 CPU ({cpu_kernels.load_error()})",
)


@pytest.mark.parametrize(("k", "n", "w"), [(576, 960, 16), (1536, 576, 8), (100, 37, 5), (64, 200, 1)])
def test_bgmv_matches_fp32(k: int, n: int, w: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    slots_total, width = 6, w + 3  # 5 adapters and a zero "none" slot; only the first w rank columns are used
    a = (torch.randn(slots_total, width, k, generator=gen) * 0.1).to(torch.bfloat16)
    bt = (torch.randn(slots_total, width, n, generator=gen) * 0.1).to(torch.bfloat16)
    a[5], bt[5] = 0, 0
    slots = torch.tensor([0, 3, 5, 3, 1, 4, 2, 5, 0])
    x = torch.randn(len(slots), k, generator=gen).to(torch.bfloat16)
    wide_out = torch.randn(len(slots), n + 10, generator=gen).to(torch.bfloat16)
    out = wide_out[:, 5 : 5 + n]  # rows strided, as out[:nd] of a merged projection may be
    base, wide_before = out.clone(), wide_out.clone()
    cpu_kernels.bgmv_(out, x, a, bt, slots, w, 5)
    h = torch.einsum("bk,bjk->bj", x.float(), a[slots, :w].float())
    expected = base.float() + torch.einsum("bj,bjn->bn", h, bt[slots, :w].float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    assert torch.equal(out[slots == 5], base[slots == 5])  # rows on the skipped slot are untouched
    assert torch.equal(wide_out[:, :5], wide_before[:, :5]) and torch.equal(
        wide_out[:, 5 + n :], wide_before[:, 5 + n :]
    )


def test_bgmv_refuses_bad_slots_and_shapes() -> None:
    a, bt = torch.zeros(3, 4, 8, dtype=torch.bfloat16), torch.zeros(3, 4, 6, dtype=torch.bfloat16)
    x, out = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 3]), 4, 2)
    with pytest.raises(RuntimeError, match="width"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 1]), 5, 2)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.bgmv_(out.float(), x, a, bt, torch.tensor([0, 1]), 4, 2)


@pytest.mark.slow
def test_bf16_engine_with_many_adapters_follows_peft_fp32(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four adapters and base rows decode in one bf16 batch through the BGMV kernel (the dense path is
    turned off). Each request's tokens, scored by PEFT in fp32 with its adapter (teacher forcing), must
    be that model's top token or within bf16 noise of it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(LoRABatch, "DENSE_MAX_SLOTS", 0)
    adapters = {
        name: make_peft_adapter(smollm2_dir, tmp_path / name, seed=i, b_scale=1.0, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    engine = LLMEngine(
        EngineConfig(model=str(smollm2_dir), dtype="bfloat16", max_loras=4, max_lora_rank=16, max_num_seqs=8)
    )
    assert engine.layer_backend == "cpu_kernel"
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
    texts = ["The capital of France is", "Once upon a time", "def add(a, b):", "Three primary colors are"]
    work = [(name, engine.tokenizer.encode(texts[i])) for i, name in enumerate(adapters)]
    work.append((None, engine.tokenizer.encode("The sea is")))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    rids = [engine.add_request(prompt, params, adapter_id=name) for name, prompt in work]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out.token_ids
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    for (name, prompt), rid in zip(work, rids, strict=True):
        model = base if name is None else PeftModel.from_pretrained(base, str(adapters[name])).eval()
        chosen, best = teacher_forced(model, prompt, done[rid])
        assert bool((chosen >= best - 0.5).all()), (name, done[rid])
        if name is not None:
            base = model.unload()  # the bare base model again for the next adapter
