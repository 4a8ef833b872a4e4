"""The compiled CPU decode-attention kernel against attention written out in fp32 torch."""

from __future__ import annotations

import os

import pytest
import torch

from attention_cases import make_case, make_chunk, prefill_reference, reference
from loraplane_server.kernels import cpu_kernels

pytestmark = pytest.mark.requires_cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    # (bf16 on AVX512-BF16: head_dim 64/128 with up to 8 heads per kv head take the specialised path)
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 128, 16), (6, 2, 80, 8), (4, 1, 32, 1), (16, 2, 64, 4), (10, 1, 64, 16)],
)
def test_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    q, k_cache, v_cache, tables, lens = make_case(7, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (5, 1)])  # groups 1, 2, 3, 4, 5
@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_kernel_across_softmax_chunks(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    """The bf16 kernel (AVX-512 BF16 or AVX2) over contexts of 1 token to several 128-token chunks,
    lengths on and off the multiples of 8, 16 and 128, in scattered blocks."""
    lens = torch.tensor([1, 2, 7, 9, 16, 33, 127, 128, 129, 200, 257, 300])
    g = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    widths = (lens + block_size - 1) // block_size
    num_blocks = int(widths.sum()) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), int(widths.max()), dtype=torch.int64)
    used = 0
    for s, w in enumerate(widths.tolist()):
        tables[s, :w] = order[used : used + w]
        used += w
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * 2).to(torch.bfloat16)  # peaked softmax too
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_strided_query_rows_and_large_scores() -> None:
    """q as a view into a fused projection (rows strided), and scores large enough to overflow a naive exp."""
    q, k_cache, v_cache, tables, lens = make_case(5, 9, 3, 64, 16, torch.float32, seed=3)
    fused = torch.cat([q.flatten(1), torch.randn(5, 3 * 64)], dim=1)  # [S, (H + extra) * D]
    q_view = fused[:, : 9 * 64].view(5, 9, 64)
    assert not q_view.is_contiguous()
    out = cpu_kernels.paged_decode_attention(q_view * 30, k_cache, v_cache, tables, lens, 1.0)
    expected = reference(q_view * 30, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 5])
def test_stale_values_past_the_context_do_not_leak(dtype: torch.dtype, block_size: int) -> None:
    """A freed block keeps what its last owner wrote, inf and NaN included: the rows of a sequence's
    last block past its length must not reach its output (the bf16 kernel pairs a lone last value
    row with zeros, and masks the scores and weights past the context)."""
    q, k_cache, v_cache, tables, lens = make_case(6, 9, 3, 64, block_size, dtype, seed=21)
    lens = (lens - 1).clamp(min=1)  # partial last blocks, odd counts among them
    assert (lens % 2 == 1).any() and (lens % block_size != 0).sum() >= 4
    clean = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    for s in range(len(lens)):
        n = int(lens[s])
        last = int(tables[s, (n - 1) // block_size])
        for cache, bad in ((k_cache, float("nan")), (v_cache, float("inf"))):
            cache[last, (n - 1) % block_size + 1 :] = bad
    dirty = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)


def test_writes_into_the_given_rows_only() -> None:
    """out= a slice of the layer's output (decode rows first): filled in place, the other rows untouched."""
    q, k_cache, v_cache, tables, lens = make_case(4, 9, 3, 64, 16, torch.bfloat16, seed=2)
    full = torch.full((6, 9, 64), 7.0, dtype=torch.bfloat16)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=full[:4])
    assert got.data_ptr() == full.data_ptr()
    assert torch.equal(full[:4], cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125))
    assert (full[4:] == 7.0).all()


def test_bad_inputs_are_refused() -> None:
    q, k_cache, v_cache, tables, lens = make_case(3, 4, 2, 16, 4, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        cpu_kernels.paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="one table row per sequence"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables[:2], lens, 1.0)


def test_thread_count_does_not_change_the_result() -> None:
    q, k_cache, v_cache, tables, lens = make_case(16, 9, 3, 64, 16, torch.bfloat16, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
        torch.set_num_threads(max(2, before))
        many = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_matches_index_copy_from_strided_views(dtype: torch.dtype) -> None:
    """k and v as views into a fused q|k|v output (rows strided), scattered slots in 3 blocks of 4."""
    from loraplane_server.executor.attention import TorchAttention

    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(9, (4 + 2 + 2) * 16, generator=gen).to(dtype)  # [T, (H + 2 KVH) * D]
    k, v = qkv[:, 64:96].view(9, 2, 16), qkv[:, 96:].view(9, 2, 16)
    slots = torch.tensor([5, 0, 11, 6, 7, 1, 9, 10, 2])
    caches = [torch.randn(3, 4, 2, 16, generator=gen).to(dtype) for _ in range(2)]  # [N, B, KVH, D]
    expected = [c.clone() for c in caches]
    TorchAttention().write_kv(k, v, *expected, slots)  # index_copy_
    TorchAttention(kernel_kv_write=True).write_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    assert torch.equal(caches[0].view(12, 2, 16)[slots], k)


def test_write_kv_refuses_slots_outside_the_cache() -> None:
    k = v = torch.zeros(2, 2, 16, dtype=torch.bfloat16)
    caches = [torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    for bad in (12, -1):
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_kernels.write_kv(k, v, *caches, torch.tensor([0, bad]))
    assert not caches[0].any(), "nothing is written when a slot is refused"
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.write_kv(k.float(), v.float(), *caches, torch.tensor([0, 1]))


def test_engine_falls_back_to_torch_without_the_kernel(tiny_llama_dir) -> None:
    """Where the kernel cannot be built, auto serves on the torch path and cpu_kernel says why it cannot."""
    import subprocess
    import sys

    script = (
        "from loraplane_server.config import EngineConfig\n"
        "from loraplane_server.engine.llm_engine import LLMEngine\n"
        f"cfg = dict(model={str(tiny_llama_dir)!r}, num_kv_blocks=16)\n"
        "engine = LLMEngine(EngineConfig(**cfg, dtype='bfloat16'))\n"
        "print(engine.attention_backend, engine.layer_backend)\n"
        "try:\n"
        "    LLMEngine(EngineConfig(**cfg, dtype='float32', attention_backend='cpu_kernel'))\n"
        "except RuntimeError as error:\n"
        "    print('refused:', error)\n"
    )
    env = {**os.environ, "LORAPLANE_DISABLE_CPU_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "torch torch"
    assert lines[1].startswith("refused:") and "LORAPLANE_DISABLE_CPU_KERNELS" in lines[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])  # bf16: the AVX kernel at 64, the portable loop at 80
@pytest.mark.parametrize("window", [1, 7, 16, 100, 1000])
def test_sliding_window(dtype: torch.dtype, head_dim: int, window: int) -> None:
    """A sliding-window layer's decode: each row's last `window` positions alone, over lengths that cross
    blocks and the bf16 kernel's 128-token chunks; the blocks wholly before the window hold NaN (never read)."""
    block_size, kv_heads, heads = 16, 2, 6
    lens = torch.tensor([1, 9, 16, 17, 100, 129, 200, 300])
    g = torch.Generator().manual_seed(window + head_dim)
    widths = (lens + block_size - 1) // block_size
    num_blocks = int(widths.sum()) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.zeros(len(lens), int(widths.max()), dtype=torch.int64)
    order, used = torch.randperm(num_blocks, generator=g), 0
    for s, w in enumerate(widths.tolist()):
        tables[s, :w] = order[used : used + w]
        used += w
    q = (torch.randn(len(lens), heads, head_dim, generator=g) * 2).to(dtype)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125, window)
    for s, n in enumerate(lens.tolist()):
        for b in range(max(0, n - window) // block_size):  # blocks wholly before the window
            k_cache[tables[s, b]] = float("nan")
            v_cache[tables[s, b]] = float("nan")
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    if window >= 300:  # no row outgrows it: the same as no window
        plain = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
        assert torch.equal(out, plain)


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 64), (8, 2, 128), (5, 5, 64)])
@pytest.mark.parametrize("window", [1, 5, 16, 21, 70, 1000])  # one token, under a block, a block, off both, past all
@pytest.mark.parametrize(
    ("n", "ctx"),
    [(37, 0), (100, 0), (45, 70), (1, 130), (9, 200), (80, 150), (64, 3)],  # fresh prompts; chunks over a context
)
def test_prefill_sliding_window(n: int, ctx: int, window: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """A sliding-window layer's prefill chunk (csrc/prefill_attention_cpu.cpp): query i at position ctx + i sees
    positions ctx + i - window + 1 .. ctx + i alone, across query tiles of 32 and key tiles of 64; the blocks
    wholly before the chunk's first window hold NaN (the block manager may have released them: never read)."""
    block_size = 16
    q, k_cache, v_cache, table = make_chunk(n, ctx, heads, kv_heads, head_dim, block_size, seed=n + ctx + window)
    scale = head_dim**-0.5
    expected = prefill_reference(q, k_cache, v_cache, table, ctx, scale, window)
    plain = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(plain, q, k_cache, v_cache, table, ctx, scale)
    for b in range(max(0, ctx - window + 1) // block_size):
        k_cache[table[b]] = float("nan")
        v_cache[table[b]] = float("nan")
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, ctx, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    if window >= ctx + n:  # no query outgrows it: the same bits as no window
        assert torch.equal(out, plain)
