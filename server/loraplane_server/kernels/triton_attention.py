"""Paged attention in Triton: the CUDA counterparts of csrc/paged_attention_cpu.cpp and
csrc/prefill_attention_cpu.cpp.

Decode: one program per (sequence, kv head) walks the sequence's block table, loads each KV block in place
(no gather, no padded copy), and keeps an online softmax for the query heads of that kv group (GQA), so a
decode step reads every attended key and value once.

Prefill over a cached context: one program per (tile of the chunk's queries, head) walks the keys from the
first position to the tile's last query through the block table, causal, with an online softmax and tl.dot
on both products: a later chunk of a long prompt, or a prompt after a prefix-cache hit, reads its context in
place instead of gathering a copy of it.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

import torch

from loraplane_server.kernels.triton_lora import _HAS_TRITON, _dot_args, _jit, triton_available

if _HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["paged_decode_attention", "paged_prefill_attention", "triton_available"]


@_jit
def _paged_decode_kernel(
    out_ptr: tl.tensor,  # [S, H, D]
    q_ptr: tl.tensor,  # [S, H, D], rows q_stride apart
    k_ptr: tl.tensor,  # [N, B, KVH, D]
    v_ptr: tl.tensor,  # [N, B, KVH, D]
    tables_ptr: tl.tensor,  # [S, W] int64
    lens_ptr: tl.tensor,  # [S] int64
    scale: float,
    q_stride: int,
    out_stride: int,
    cache_block_stride: int,
    table_stride: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int,  # a sliding window: the last `window` positions alone; 0: all of them
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    s = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + s)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_N)
    gd_mask = (g < group)[:, None] & (d < head_dim)[None, :]
    heads = h * group + g
    q = tl.load(q_ptr + s * q_stride + heads[:, None] * head_dim + d[None, :], mask=gd_mask, other=0.0)
    q = q.to(tl.float32) * scale
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    num_blocks = tl.cdiv(ctx, block_size)
    first = tl.maximum(ctx - window, 0) if window > 0 else 0  # the blocks wholly before it are never read
    for b in range(first // block_size, num_blocks):
        block = tl.load(tables_ptr + s * table_stride + b)
        token_mask = (t < block_size) & (b * block_size + t < ctx) & (b * block_size + t >= first)
        offs = block * cache_block_stride + t[:, None] * (num_kv_heads * head_dim) + h * head_dim + d[None, :]
        kv_mask = token_mask[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + s * out_stride + heads[:, None] * head_dim + d[None, :], out, mask=gd_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q: [S, H, D]; caches: [N, B, KVH, D]; block_tables: [S, W] int64; context_lens: [S] (>= 1) -> [S, H, D];
    window > 0: each row attends its last `window` positions alone (a sliding-window layer)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q rows and the caches must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        scale,
        q.stride(0),
        out.stride(0),
        k_cache.stride(0),
        tables.stride(0),
        num_kv_heads,
        group,
        head_dim,
        block_size,
        window,
        BLOCK_G=max(triton.next_power_of_2(group), 1),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=triton.next_power_of_2(block_size),
    )
    return out


@_jit
def _paged_prefill_kernel(
    out_ptr: tl.tensor,  # [n, H, D]
    q_ptr: tl.tensor,  # [n, H, D], rows q_stride apart
    k_ptr: tl.tensor,  # [N, B, KVH, D]
    v_ptr: tl.tensor,  # [N, B, KVH, D]
    table_ptr: tl.tensor,  # [W] int64: the blocks of positions 0 .. ctx + n - 1
    ctx: int,
    num_query: int,
    scale: float,
    q_stride: int,
    out_stride: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    window: int,  # a sliding window: keys within `window` positions of the query alone; 0: every earlier key
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_N)
    row_mask = rows < num_query
    d_mask = d < head_dim
    q = tl.load(q_ptr + rows[:, None] * q_stride + h * head_dim + d[None, :], mask=row_mask[:, None] & d_mask[None, :])
    q = q.to(DOT_DTYPE)
    query_pos = ctx + rows  # [M]: a padding row past the chunk sees every key, so its softmax stays finite
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(ctx + m0 + BLOCK_M, ctx + num_query)  # keys past the tile's last query are never seen
    head_offset = (h // group) * head_dim
    start = 0
    if window > 0:  # the key tiles wholly before the tile's first query's window are never read
        start = (tl.maximum(ctx + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + t
        key_mask = keys < end
        block = tl.load(table_ptr + keys // block_size, mask=key_mask, other=0)
        cache_rows = block * block_size + keys % block_size  # [N] rows of the flattened cache
        offs = cache_rows[:, None] * (num_kv_heads * head_dim) + head_offset + d[None, :]
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [N, D]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N]
        visible = (keys[None, :] <= query_pos[:, None]) & key_mask[None, :]
        if window > 0:
            visible = visible & (keys[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # a row that has seen no key yet (a window starting past this tile) keeps its zeros, not -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(
        out_ptr + rows[:, None] * out_stride + h * head_dim + d[None, :], out, mask=row_mask[:, None] & d_mask[None, :]
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context_tokens: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One prefill chunk's causal attention over its cached context plus itself, both read from the cache:
    q [n, H, D] at positions ctx .. ctx + n - 1 (the chunk's own keys and values already written);
    caches [N, B, KVH, D]; block_table [W] int64 covering ctx + n positions -> out [n, H, D]; window > 0: a
    query at p attends keys p - window < j <= p alone (a sliding-window layer)."""
    num_query, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q rows and the caches must be contiguous")
    if block_table.numel() * block_size < num_context_tokens + num_query:
        raise ValueError(f"the block table does not cover {num_context_tokens + num_query} positions")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if out.shape != q.shape or out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"out {tuple(out.shape)} must be [n, H, D] with contiguous rows")
    if num_query == 0:
        return out
    block_m = 16 if num_query <= 16 else 64
    table = block_table.to(torch.int64).contiguous()
    _paged_prefill_kernel[(triton.cdiv(num_query, block_m), num_heads)](
        out, q, k_cache, v_cache, table,
        num_context_tokens, num_query, scale,
        q.stride(0), out.stride(0),
        num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, window,
        **_dot_args(q.dtype), BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )  # fmt: skip
    return out
