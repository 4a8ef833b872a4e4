"""The compiled CPU decode-attention kernel against attention written out in fp32 torch."""

from __future__ import annotations

import pytest
import torch

from loraplane_server.layers import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason=f"kernel did not build: {cpu_kernels.load_error()}")


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per sequence: its tokens' keys and values in order, softmax(q k^T * scale) v, in fp32."""
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        blocks = tables[s, : -(-n // block_size)]
        keys = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float(), keys) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def make_case(
    num_seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6 * block_size, (num_seqs,), generator=g)
    lens[0], lens[-1] = 1, 3 * block_size  # one token; an exact multiple of the block size
    widths = (lens + block_size - 1) // block_size
    num_blocks = int(widths.sum()) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)  # blocks scattered over the pool
    tables = torch.zeros(num_seqs, int(widths.max()), dtype=torch.int64)  # padded with block 0
    used = 0
    for s, w in enumerate(widths.tolist()):
        tables[s, :w] = order[used : used + w]
        used += w
    q = torch.randn(num_seqs, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 128, 16), (6, 2, 80, 8), (4, 1, 32, 1)],
)
def test_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    q, k_cache, v_cache, tables, lens = make_case(7, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


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
