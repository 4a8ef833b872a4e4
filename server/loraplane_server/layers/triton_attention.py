"""Paged decode attention in Triton: the CUDA counterpart of csrc/paged_attention_cpu.cpp.

One program per (sequence, kv head) walks the sequence's block table, loads each KV block in place
(no gather, no padded copy), and keeps an online softmax for the query heads of that kv group
(GQA), so a decode step reads every attended key and value once.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

import torch

from loraplane_server.lora.triton_kernels import _HAS_TRITON, _jit, triton_available

if _HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["paged_decode_attention", "triton_available"]


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
    for b in range(0, num_blocks):
        block = tl.load(tables_ptr + s * table_stride + b)
        token_mask = (t < block_size) & (b * block_size + t < ctx)
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
) -> torch.Tensor:
    """q: [S, H, D]; caches: [N, B, KVH, D]; block_tables: [S, W] int64; context_lens: [S] (>= 1) -> [S, H, D]."""
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
        BLOCK_G=max(triton.next_power_of_2(group), 1),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=triton.next_power_of_2(block_size),
    )
    return out
