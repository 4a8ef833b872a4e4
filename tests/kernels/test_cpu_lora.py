"""The CPU BGMV kernel (csrc/lora_cpu.cpp) against the LoRA math in fp32, and a bf16 engine serving
many adapters at once (decode and prefill rows through the kernel), scored against PEFT in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, run_all

from lora_helpers import ADAPTER_SPECS, make_peft_adapter, teacher_forced
from loraplane_server.executor.lora.backends import TorchBackend
from loraplane_server.kernels import cpu_kernels
from loraplane_server.sampling_params import SamplingParams

pytestmark = pytest.mark.requires_cpu_kernels  # the BGMV kernels themselves: requires_bf16_kernels


def reference_delta(
    x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor, proj_rows: torch.Tensor, bounds: list[int]
) -> torch.Tensor:
    """fp32 delta [B, N]: each row's slot, each projection's own rank rows against its own columns."""
    delta = torch.zeros(x.shape[0], bt.shape[-1])
    for row, s in enumerate(slots.tolist()):
        for p in range(len(bounds) - 1):
            r0, nr = proj_rows[s, p].tolist()
            h = a[s, r0 : r0 + nr].float() @ x[row].float()  # [nr]
            delta[row, bounds[p] : bounds[p + 1]] += h @ bt[s, r0 : r0 + nr, bounds[p] : bounds[p + 1]].float()
    return delta


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize(
    ("k", "bounds", "rank"),
    [
        (576, [0, 576, 768, 960], 8),
        (576, [0, 1536, 3072], 16),
        (1536, [0, 576], 8),
        (100, [0, 20, 20, 37], 5),
        (72, [0, 7, 88, 183], 9),  # K a multiple of 8 but not 16; widths across a pass and its tail
        (33, [0, 1, 161], 1),  # odd K, rank 1 everywhere, a one-column projection
    ],
)
def test_bgmv_matches_fp32(k: int, bounds: list[int], rank: int) -> None:
    """Block-diagonal slots as executor/lora/slots.py lays them out: slot s's projection p on rank rows
    [p*r, p*r + r_p). Ranks differ per slot, some projections are absent, slot 5 is the zero "none"
    slot; decode rows on single slots, then prefill runs of one slot."""
    gen = torch.Generator().manual_seed(k + bounds[-1])
    n, num_p, total = bounds[-1], len(bounds) - 1, 6
    width = num_p * rank
    a = torch.zeros(total, width, k, dtype=torch.bfloat16)
    bt = torch.zeros(total, width, n, dtype=torch.bfloat16)
    proj_rows = torch.zeros(total, num_p, 2, dtype=torch.int64)
    for s in range(5):
        r = max(1, rank - s)  # the slot's own rank
        for p in range(num_p):
            if (s + p) % 3 == 2:
                continue  # projection p not targeted by slot s's adapter
            rows = slice(p * r, p * r + r)
            a[s, rows] = (torch.randn(r, k, generator=gen) * 0.1).to(torch.bfloat16)
            bt[s, rows, bounds[p] : bounds[p + 1]] = (
                torch.randn(r, bounds[p + 1] - bounds[p], generator=gen) * 0.1
            ).to(torch.bfloat16)
            proj_rows[s, p] = torch.tensor([p * r, r])
    slots = torch.tensor([0, 3, 5, 3, 1, 4, 2, 5, 0] + [2] * 7 + [5] * 3 + [4] * 20)
    x = torch.randn(len(slots), k, generator=gen).to(torch.bfloat16)
    wide_out = torch.randn(len(slots), n + 10, generator=gen).to(torch.bfloat16)
    out = wide_out[:, 5 : 5 + n]  # rows strided, as a slice of a merged projection's output may be
    base, wide_before = out.clone(), wide_out.clone()
    cpu_kernels.bgmv_(out, x, a, bt, slots, proj_rows, torch.tensor(bounds), 5)
    expected = base.float() + reference_delta(x, a, bt, slots, proj_rows, bounds)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    assert torch.equal(out[slots == 5], base[slots == 5])  # rows on the skipped slot are untouched
    assert torch.equal(wide_out[:, :5], wide_before[:, :5]) and torch.equal(
        wide_out[:, 5 + n :], wide_before[:, 5 + n :]
    )
    # the zero blocks are not read: filling them with garbage changes nothing
    for s in range(5):
        owned = torch.zeros(width, dtype=torch.bool)
        for p in range(num_p):
            r0, nr = proj_rows[s, p].tolist()
            owned[r0 : r0 + nr] = True
            others = torch.ones(n, dtype=torch.bool)
            others[bounds[p] : bounds[p + 1]] = False
            bt[s, r0 : r0 + nr, others] = 1e4  # other projections' columns of these rows
        a[s, ~owned], bt[s, ~owned] = 1e4, 1e4  # rows of no projection (absent ones, the rank's tail)
    again = base.clone()
    cpu_kernels.bgmv_(again, x, a, bt, slots, proj_rows, torch.tensor(bounds), 5)
    assert torch.equal(again, out)

    # the packed layout (executor/lora/slots.py with the CPU kernels): the same products, bit for bit
    packed, proj = pack(a, bt, proj_rows, bounds, filler=1e4)
    once_more = base.clone()
    cpu_kernels.bgmv_packed_(once_more, x, packed, slots, proj, torch.tensor(bounds), 5)
    assert torch.equal(once_more, out)


def pack(
    a: torch.Tensor, bt: torch.Tensor, proj_rows: torch.Tensor, bounds: list[int], filler: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense slots' used blocks as slots.py packs them: per slot, A_p then B_p^T for each targeted p,
    in a run padded with `filler` (never read)."""
    total, num_p, k = a.shape[0], len(bounds) - 1, a.shape[-1]
    cap = sum(a.shape[1] * (k + bounds[p + 1] - bounds[p]) for p in range(num_p)) + 7
    packed = torch.full((total, cap), filler, dtype=torch.bfloat16)
    proj = torch.zeros(total, num_p, 2, dtype=torch.int64)
    for s in range(total):
        offset = 3  # not at the start of the run
        for p in range(num_p):
            r0, nr = proj_rows[s, p].tolist()
            if nr == 0:
                continue
            block_a = a[s, r0 : r0 + nr].reshape(-1)
            block_b = bt[s, r0 : r0 + nr, bounds[p] : bounds[p + 1]].reshape(-1)
            packed[s, offset : offset + block_a.numel()] = block_a
            packed[s, offset + block_a.numel() : offset + block_a.numel() + block_b.numel()] = block_b
            proj[s, p] = torch.tensor([offset, nr])
            offset += block_a.numel() + block_b.numel()
    return packed, proj


@pytest.mark.requires_bf16_kernels
def test_bgmv_over_many_slots_matches_fp32() -> None:
    """A decode batch of 64 rows over 40 adapters (ranks 1..16, odd ones too), some rows on the skipped
    slot: each row its own slot's delta, the dense and packed layouts bit for bit alike."""
    gen = torch.Generator().manual_seed(40)
    k, bounds, total, skip = 200, [0, 96, 130, 243], 41, 40
    n, num_p, width = bounds[-1], len(bounds) - 1, 3 * 16
    a = torch.zeros(total, width, k, dtype=torch.bfloat16)
    bt = torch.zeros(total, width, n, dtype=torch.bfloat16)
    proj_rows = torch.zeros(total, num_p, 2, dtype=torch.int64)
    for s in range(skip):
        r = 1 + s % 16
        for p in range(num_p):
            if (s + p) % 4 == 3:
                continue
            a[s, p * r : p * r + r] = (torch.randn(r, k, generator=gen) * 0.1).to(torch.bfloat16)
            cols = bounds[p + 1] - bounds[p]
            bt[s, p * r : p * r + r, bounds[p] : bounds[p + 1]] = (torch.randn(r, cols, generator=gen) * 0.1).to(
                torch.bfloat16
            )
            proj_rows[s, p] = torch.tensor([p * r, r])
    slots = torch.randint(0, total, (64,), generator=gen)
    slots[::9] = skip
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16)
    base = torch.randn(64, n, generator=gen).to(torch.bfloat16)
    out = base.clone()
    cpu_kernels.bgmv_(out, x, a, bt, slots, proj_rows, torch.tensor(bounds), skip)
    expected = base.float() + reference_delta(x, a, bt, slots, proj_rows, bounds)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    assert torch.equal(out[slots == skip], base[slots == skip])
    packed, proj = pack(a, bt, proj_rows, bounds, filler=float("nan"))  # NaN filler: never read
    again = base.clone()
    cpu_kernels.bgmv_packed_(again, x, packed, slots, proj, torch.tensor(bounds), skip)
    assert torch.equal(again, out)


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize("k", [2, 40])
@pytest.mark.parametrize("n", [1, 19, 100])
def test_bgmv_rounds_h_to_bf16_and_each_output_once(k: int, n: int) -> None:
    """Values picked so that each rounding shows in the result's bits. Row 0: h = 1 + 3 * 2^-9 (not a
    bf16) times B = 1.5 onto 0 gives 1.515625 with h rounded to bf16 first (1.0078125 * 1.5, a tie
    to even), 1.5078125 without. Row 1: onto 1.0 a delta of 2^-8 + 2^-20 gives 1.0078125 rounded once,
    1.0 when the delta is rounded to bf16 (2^-8) before the add (a tie to even)."""
    a = torch.zeros(2, 2, k, dtype=torch.bfloat16)
    bt = torch.zeros(2, 2, n, dtype=torch.bfloat16)
    a[0, 0, :2] = torch.tensor([1.0, 3 * 2**-9])
    bt[0, 0] = 1.5
    a[1, 0, 0], a[1, 1, 0] = 1.0, 2**-10
    bt[1, 0], bt[1, 1] = 2**-8, 2**-10
    proj_rows = torch.tensor([[[0, 1]], [[0, 2]]])
    x = torch.zeros(2, k, dtype=torch.bfloat16)
    x[:, :2] = 1.0
    out = torch.stack([torch.zeros(n), torch.ones(n)]).to(torch.bfloat16)
    base = out.clone()
    slots, bounds = torch.tensor([0, 1]), torch.tensor([0, n])
    cpu_kernels.bgmv_(out, x, a, bt, slots, proj_rows, bounds, 5)
    assert out[0].float().eq(1.515625).all() and out[1].float().eq(1.0078125).all(), out
    packed, proj = pack(a, bt, proj_rows, [0, n], filler=0.0)
    cpu_kernels.bgmv_packed_(base, x, packed, slots, proj, bounds, 5)
    assert torch.equal(base, out)


@pytest.mark.requires_bf16_kernels
def test_bgmv_packed_refuses_runs_outside_the_slot() -> None:
    packed = torch.zeros(3, 40, dtype=torch.bfloat16)
    x, out = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.bfloat16)
    proj, bounds = torch.zeros(3, 2, 2, dtype=torch.int64), torch.tensor([0, 4, 6])
    proj[1, 0] = torch.tensor([0, 3])  # 3 x (8 + 4) = 36 elements: fits
    cpu_kernels.bgmv_packed_(out, x, packed, torch.tensor([0, 1]), proj, bounds, 2)
    proj[1, 1] = torch.tensor([36, 1])  # 36 + 8 + 2 = 46 > 40
    with pytest.raises(RuntimeError, match="outside the slot"):
        cpu_kernels.bgmv_packed_(out, x, packed, torch.tensor([0, 1]), proj, bounds, 2)
    proj[1, 1] = 0
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.bgmv_packed_(out, x, packed, torch.tensor([0, 3]), proj, bounds, 2)


def test_bgmv_refuses_bad_slots_and_shapes() -> None:
    a, bt = torch.zeros(3, 4, 8, dtype=torch.bfloat16), torch.zeros(3, 4, 6, dtype=torch.bfloat16)
    x, out = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.bfloat16)
    rows, bounds = torch.zeros(3, 2, 2, dtype=torch.int64), torch.tensor([0, 4, 6])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 3]), rows, bounds, 2)
    bad = rows.clone()
    bad[1, 1] = torch.tensor([2, 3])  # rows 2..4 of a 4-row slot
    with pytest.raises(RuntimeError, match="rank rows"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 1]), bad, bounds, 2)
    with pytest.raises(RuntimeError, match="out_bounds"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 1]), rows, torch.tensor([0, 4, 7]), 2)
    with pytest.raises(RuntimeError, match="out_bounds"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 1]), rows, torch.tensor([0, 5, 4]), 2)
    with pytest.raises(RuntimeError, match="proj_rows"):
        cpu_kernels.bgmv_(out, x, a, bt, torch.tensor([0, 1]), rows[:, :1].contiguous(), bounds, 2)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.bgmv_(out.float(), x, a, bt, torch.tensor([0, 1]), rows, bounds, 2)


@pytest.mark.slow
@pytest.mark.requires_bf16_kernels
def test_bf16_engine_with_many_adapters_follows_peft_fp32(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four adapters and base rows decode in one bf16 batch through the BGMV kernel (the dense path is
    turned off). Each request's tokens, scored by PEFT in fp32 with its adapter (teacher forcing), must
    be that model's top token or within bf16 noise of it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(TorchBackend, "DENSE_MAX_SLOTS", 0)
    adapters = {
        name: make_peft_adapter(smollm2_dir, tmp_path / name, seed=i, b_scale=1.0, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    engine = make_engine(smollm2_dir, dtype="bfloat16", max_loras=4, max_lora_rank=16, max_num_seqs=8)
    assert engine.layer_backend == "cpu_kernel"
    slots = engine.runner.lora_slots
    assert slots.packed is not None and not slots.a and not slots.bt  # the kernel's packed layout only
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
    texts = ["The capital of France is", "Once upon a time", "def add(a, b):", "Three primary colors are"]
    work = [(name, engine.tokenizer.encode(texts[i])) for i, name in enumerate(adapters)]
    work.append((None, engine.tokenizer.encode("The sea is")))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    rids = [engine.add_request(prompt, params, adapter_id=name) for name, prompt in work]
    done = {rid: out.token_ids for rid, out in run_all(engine, check_errors=True).items()}
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    for (name, prompt), rid in zip(work, rids, strict=True):
        model = base if name is None else PeftModel.from_pretrained(base, str(adapters[name])).eval()
        chosen, best = teacher_forced(model, prompt, done[rid])
        assert bool((chosen >= best - 0.5).all()), (name, done[rid])
        if name is not None:
            base = model.unload()  # the bare base model again for the next adapter
