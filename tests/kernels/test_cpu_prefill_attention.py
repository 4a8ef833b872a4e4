"""The CPU prefill-attention kernel (csrc/prefill_attention_cpu.cpp) against causal attention in fp32."""

from __future__ import annotations

import pytest
import torch

from attention_cases import make_chunk
from attention_cases import prefill_reference as reference
from loraplane_server.kernels import cpu_kernels

pytestmark = pytest.mark.requires_cpu_kernels  # the kernel itself: requires_bf16_kernels


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize(
    ("n", "ctx", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (1, 0, 9, 3, 64, 16),  # a one-token prompt
        (37, 0, 9, 3, 64, 16),  # a fresh prompt, partial tiles
        (100, 0, 4, 4, 128, 16),  # head_dim 128, no GQA
        (64, 45, 9, 3, 64, 16),  # a later chunk: cached context, unaligned
        (33, 200, 8, 1, 64, 4),  # long context, 8 heads per kv head, small blocks
        (19, 5, 6, 2, 64, 1),  # block size 1 (keys of one tile span blocks)
        (70, 30, 6, 3, 128, 8),
        (50, 20, 8, 4, 128, 16),  # heads in register blocks of 2 (head_dim 128)
        (41, 0, 4, 2, 64, 16),  # blocks of 2 (head_dim 64)
        (29, 70, 12, 3, 64, 16),  # blocks of 4
        (23, 3, 5, 1, 64, 16),  # 5 heads per kv head: blocks of 1
        (30, 17, 9, 3, 128, 16),  # head_dim 128, 3 heads per kv head (AVX2: blocks of 3)
        (45, 70, 16, 4, 128, 32),  # head_dim 128, 4 heads per kv head (AVX2: blocks of 4), block size 32
        (66, 0, 3, 3, 64, 32),  # no GQA, block size 32, tiles of 64 keys and 2 more
        (1, 130, 4, 4, 128, 32),  # one query after a long context
        (1, 0, 8, 2, 128, 16),  # a one-token prompt, head_dim 128
        (9, 120, 8, 2, 64, 16),  # a short chunk whose keys end off the tile and vector boundaries
    ],
)
def test_matches_fp32_causal_attention(
    n: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    q, k_cache, v_cache, table = make_chunk(n, ctx, heads, kv_heads, head_dim, block_size, seed=n + ctx)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, ctx, scale)
    expected = reference(q, k_cache, v_cache, table, ctx, scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.requires_bf16_kernels
def test_writes_strided_rows_in_place_and_is_thread_invariant() -> None:
    q, k_cache, v_cache, table = make_chunk(50, 20, 9, 3, 64, 16, seed=1)
    wide = torch.zeros(50, 12, 64, dtype=torch.bfloat16)  # q as a view into a wider projection output
    wide[:, :9] = q
    q_view = wide[:, :9]
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = torch.empty(50, 9, 64, dtype=torch.bfloat16)
            cpu_kernels.paged_prefill_attention(out, q_view, k_cache, v_cache, table, 20, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].float(), reference(q, k_cache, v_cache, table, 20, 0.125), atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_refused() -> None:
    q, k_cache, v_cache, table = make_chunk(8, 0, 4, 2, 64, 16, seed=2)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.paged_prefill_attention(out.float(), q.float(), k_cache.float(), v_cache.float(), table, 0, 0.1)
    with pytest.raises(RuntimeError, match="cover"):
        cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, 100, 0.1)
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_kernels.paged_prefill_attention(out[..., :32], q[..., :32], k_cache, v_cache, table, 0, 0.1)


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize("head_dim", [64, 128])
def test_stale_rows_past_the_chunk_do_not_leak(head_dim: int) -> None:
    """A block's rows past ctx + n keep what a former owner wrote (NaN, inf): they must not reach the output."""
    n, ctx, block_size = 21, 14, 16  # 35 tokens: the last block holds 3, 13 stale rows follow
    q, k_cache, v_cache, table = make_chunk(n, ctx, 6, 2, head_dim, block_size, seed=head_dim)
    clean = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(clean, q, k_cache, v_cache, table, ctx, 0.125)
    last = int(table[(ctx + n - 1) // block_size])
    k_cache[last, (ctx + n) % block_size :] = float("nan")
    v_cache[last, (ctx + n) % block_size :] = float("inf")
    dirty = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(dirty, q, k_cache, v_cache, table, ctx, 0.125)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)
