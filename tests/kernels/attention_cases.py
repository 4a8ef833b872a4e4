"""Paged decode- and prefill-attention cases and their fp32 references, shared by the CPU and Triton kernel tests."""

from __future__ import annotations

import torch


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Per sequence: its tokens' keys and values in order (its last `window` alone where > 0),
    softmax(q k^T * scale) v, in fp32."""
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        blocks = tables[s, : -(-n // block_size)]
        keys = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        if window:
            keys, values = keys[max(0, n - window) :], values[max(0, n - window) :]
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


def make_chunk(
    n: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sequence of ctx + n tokens in scattered cache blocks; q for its last n positions."""
    g = torch.Generator().manual_seed(seed)
    total = ctx + n
    num_blocks = -(-total // block_size)
    pool = num_blocks + 7
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(pool, generator=g)[:num_blocks].contiguous()
    q = (torch.randn(n, heads, head_dim, generator=g) * 2).to(dtype)
    return q, k_cache, v_cache, table


def prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    ctx: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Query i (position ctx + i) attends to keys 0..ctx + i (those past ctx + i - window alone where window > 0),
    in fp32."""
    n, heads, _ = q.shape
    keys = k_cache[table].flatten(0, 1)[: ctx + n].float()  # [L, KVH, D]
    values = v_cache[table].flatten(0, 1)[: ctx + n].float()
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    keys_at, query_at = torch.arange(ctx + n)[None, :], (ctx + torch.arange(n))[:, None]
    visible = keys_at <= query_at  # [n, L]
    if window:
        visible &= keys_at > query_at - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
