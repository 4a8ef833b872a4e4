"""Attention over a paged KV cache: write this step's keys and values, then attend.

Decodes (one query each) run as one batched call: through a kernel that reads the blocks in place
(the compiled CPU kernel in layers/cpu_kernels.py, or Triton on CUDA in layers/triton_attention.py),
or, on the torch path, SDPA over a padded gather of their blocks. Each prefill chunk runs on its
own (few per step), attending to its cached context plus itself: with the CPU kernels, bf16, a
flash-attention kernel that reads the blocks in place; otherwise SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplane_server.forward_batch import ForwardBatch, PrefillChunk
from loraplane_server.layers import cpu_kernels, triton_attention


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kernel: bool = False,
) -> None:
    # k, v: [T, KVH, D]; caches: [N, B, KVH, D]
    if kernel:  # the CPU kernels: one row copy per token (index_copy_ is slow on the strided k, v views)
        cpu_kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] for this step's tokens -> [T, H, D]."""
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.layer_kernels)
    out = torch.empty_like(q)
    nd = batch.num_decode_tokens
    if nd and batch.decode_attention != "torch":
        assert batch.decode_block_tables is not None and batch.decode_context_lens is not None
        tables, lens = batch.decode_block_tables, batch.decode_context_lens
        if batch.decode_attention == "cpu_kernel":
            cpu_kernels.paged_decode_attention(q[:nd], k_cache, v_cache, tables, lens, scale, out=out[:nd])
        else:
            out[:nd] = triton_attention.paged_decode_attention(q[:nd], k_cache, v_cache, tables, lens, scale)
    elif nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, batch, scale)
    prefill_kernel = batch.decode_attention == "cpu_kernel" and cpu_kernels.prefill_kernel_applies(q)
    for chunk in batch.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        if prefill_kernel:
            ctx = chunk.num_context_tokens
            cpu_kernels.paged_prefill_attention(out[rows], q[rows], k_cache, v_cache, chunk.block_table, ctx, scale)
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    # [..., NB] block ids -> [..., NB * B, KVH, D]
    g = cache[block_table]
    return g.flatten(-4, -3)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    assert batch.decode_block_tables is not None and batch.decode_mask is not None
    bd, h, d = q.shape
    kvh = k_cache.shape[2]
    keys = _gather(k_cache, batch.decode_block_tables).transpose(1, 2)  # [Bd, KVH, L, D]
    values = _gather(v_cache, batch.decode_block_tables).transpose(1, 2)
    # masked positions are padding or another sequence's stale rows: zeroed, as a NaN there would reach
    # this row through SDPA (0 x NaN)
    outside = ~batch.decode_mask.transpose(-1, -2)  # [Bd, 1, L, 1]
    keys, values = keys.masked_fill_(outside, 0.0), values.masked_fill_(outside, 0.0)
    # the query heads of one kv group ride the query-length axis: no kv repeat needed
    qg = q.view(bd, kvh, h // kvh, d)  # [Bd, KVH, G, D]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=batch.decode_mask, scale=scale)
    return out.reshape(bd, h, d)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    n, ctx = chunk.num_query_tokens, chunk.num_context_tokens
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if ctx == 0:
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
        out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = ctx + n
        keys = _gather(k_cache, chunk.block_table)[:total].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        values = _gather(v_cache, chunk.block_table)[:total].transpose(0, 1).unsqueeze(0)
        qpos = torch.arange(ctx, total, device=q.device).unsqueeze(1)
        mask = torch.arange(total, device=q.device).unsqueeze(0) <= qpos  # [n, L]
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [n, H, D]
