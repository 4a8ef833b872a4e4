"""The Triton paged decode- and prefill-attention kernels against fp32 attention, under the Triton interpreter on
the CPU (on CUDA where a GPU is, bench/gpu.py's run)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest
import torch

from attention_cases import make_case, make_chunk, prefill_reference, reference
from loraplane_server.kernels.triton_attention import paged_decode_attention, paged_prefill_attention, triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1"),
    pytest.mark.triton,
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (6, 2, 80, 8)])
def test_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    q, k_cache, v_cache, tables, lens = make_case(5, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim**-0.5
    args = [x.to(DEVICE) for x in (q, k_cache, v_cache, tables, lens)]
    out = paged_decode_attention(*args, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def test_strided_query_rows() -> None:
    q, k_cache, v_cache, tables, lens = make_case(3, 4, 2, 16, 4, torch.float32, seed=2)
    fused = torch.cat([q.flatten(1), torch.randn(3, 32)], dim=1)
    q_view = fused[:, : 4 * 16].view(3, 4, 16)
    out = paged_decode_attention(*(x.to(DEVICE) for x in (q_view, k_cache, v_cache, tables, lens)), 0.5)
    torch.testing.assert_close(out.cpu(), reference(q_view, k_cache, v_cache, tables, lens, 0.5), atol=1e-5, rtol=1e-5)


def test_shape_mismatch_is_refused() -> None:
    q, k_cache, v_cache, tables, lens = make_case(2, 4, 2, 16, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 1.0)


@pytest.mark.parametrize(
    ("n", "ctx", "heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        (1, 30, 4, 2, 64, 16, torch.float32),  # one query after a context
        (37, 45, 9, 3, 64, 16, torch.float32),  # partial tiles, unaligned context
        (70, 130, 8, 1, 64, 4, torch.float32),  # two query tiles, many small blocks, 8 heads per kv head
        (19, 5, 6, 2, 80, 1, torch.float32),  # block size 1, head_dim not a power of two
        (16, 64, 4, 4, 128, 32, torch.bfloat16),  # no GQA, exact tiles
        (33, 20, 6, 3, 64, 8, torch.float16),
    ],
)
def test_prefill_matches_causal_attention(
    n: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    q, k_cache, v_cache, table = make_chunk(n, ctx, heads, kv_heads, head_dim, block_size, seed=n + ctx, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_prefill_attention(*(x.to(DEVICE) for x in (q, k_cache, v_cache, table)), ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    expected = prefill_reference(q, k_cache, v_cache, table, ctx, scale)
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 5, 16, 40, 500])  # one key; within a block; a block; blocks; past all
def test_decode_with_a_sliding_window(window: int) -> None:
    """A sliding-window layer's decode: each row's last `window` positions alone (the blocks before them unread:
    they hold NaN here)."""
    q, k_cache, v_cache, tables, lens = make_case(6, 6, 2, 64, 8, torch.float32, seed=window)
    assert int(lens.max()) > min(window, 24)  # some row reaches past the window (lengths up to 48)
    for s, n in enumerate(lens.tolist()):  # poison every position before the window
        for pos in range(max(0, n - window)):
            k_cache[tables[s, pos // 8], pos % 8] = float("nan")
    out = paged_decode_attention(*(x.to(DEVICE) for x in (q, k_cache, v_cache, tables, lens)), 0.125, window)
    torch.testing.assert_close(
        out.cpu(), reference(q, k_cache, v_cache, tables, lens, 0.125, window), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    ("n", "ctx", "window"),
    [(70, 0, 9), (37, 45, 16), (20, 130, 64), (65, 3, 1), (16, 64, 100)],  # a fresh chunk; cached; tiles skipped
)
def test_prefill_with_a_sliding_window(n: int, ctx: int, window: int) -> None:
    q, k_cache, v_cache, table = make_chunk(n, ctx, 6, 2, 64, 4, seed=n + window, dtype=torch.float32)
    out = paged_prefill_attention(*(x.to(DEVICE) for x in (q, k_cache, v_cache, table)), ctx, 0.125, window=window)
    expected = prefill_reference(q, k_cache, v_cache, table, ctx, 0.125, window)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_ignores_stale_rows_and_writes_strided_out() -> None:
    """Rows of the last block past the chunk hold a former owner's NaN and inf: never read; out may be a view."""
    n, ctx, block_size = 21, 14, 16
    q, k_cache, v_cache, table = make_chunk(n, ctx, 6, 2, 64, block_size, seed=5, dtype=torch.float32)
    last = int(table[(ctx + n - 1) // block_size])
    k_cache[last, (ctx + n) % block_size :] = float("nan")
    v_cache[last, (ctx + n) % block_size :] = float("inf")
    wide = torch.full((n, 8, 64), float("nan"))
    out = paged_prefill_attention(
        *(x.to(DEVICE) for x in (q, k_cache, v_cache, table)), ctx, 0.125, wide[:, :6].to(DEVICE)
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out.cpu(), prefill_reference(q, k_cache, v_cache, table, ctx, 0.125), atol=1e-5, rtol=1e-5
    )


def test_prefill_refuses_a_table_that_does_not_cover_the_chunk() -> None:
    q, k_cache, v_cache, table = make_chunk(8, 20, 4, 2, 64, 16, seed=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not cover 40 positions"):
        paged_prefill_attention(q, k_cache, v_cache, table[:1], 32, 0.1)
