"""The torch attention backend (any device, any dtype): decode rows as SDPA over a padded gather of their
blocks, each prefill chunk as SDPA over its gathered context plus itself (or over itself alone, causal,
without context). The reference path, and the prefill and KV write of the kernel backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplane_server.executor.attention.base import AttentionBackend
from loraplane_server.kernels import cpu_kernels

if TYPE_CHECKING:
    from loraplane_server.executor.forward_batch import ForwardBatch, PrefillChunk


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch, block_size: int) -> None:
        if batch.decode_block_tables is None or batch.decode_context_lens is None:
            return
        span = torch.arange(batch.decode_block_tables.shape[1] * block_size, device=batch.positions.device)
        batch.decode_mask = (span < batch.decode_context_lens.unsqueeze(1))[:, None, None, :]
        batch.decode_window_masks = {}

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # k, v: [T, KVH, D]; caches: [N, B, KVH, D]
        if self.kernel_kv_write:
            cpu_kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        out: torch.Tensor,
        window: int = 0,
    ) -> None:
        if batch.decode_mask is None:  # a kernel backend's windowed layer, here since its kernel has no window
            TorchAttention.prepare(self, batch, k_cache.shape[1])
        assert batch.decode_block_tables is not None and batch.decode_mask is not None
        mask = _window_mask(batch, window) if window else batch.decode_mask
        bd, h, d = q.shape
        kvh = k_cache.shape[2]
        keys = _gather(k_cache, batch.decode_block_tables).transpose(1, 2)  # [Bd, KVH, L, D]
        values = _gather(v_cache, batch.decode_block_tables).transpose(1, 2)
        # masked positions are padding or another sequence's stale rows: zeroed, as a NaN there would reach
        # this row through SDPA (0 x NaN)
        outside = ~mask.transpose(-1, -2)  # [Bd, 1, L, 1]
        keys, values = keys.masked_fill_(outside, 0.0), values.masked_fill_(outside, 0.0)
        # the query heads of one kv group ride the query-length axis: no kv repeat needed
        qg = q.view(bd, kvh, h // kvh, d)  # [Bd, KVH, G, D]
        attn = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        out.copy_(attn.reshape(bd, h, d))

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        out: torch.Tensor,
        window: int = 0,
    ) -> None:
        n, ctx = chunk.num_query_tokens, chunk.num_context_tokens
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ctx == 0 and not 0 < window < n:  # a fresh chunk the window spans whole: plain causal on its own k, v
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
            attn = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = ctx + n
            keys = _gather(k_cache, chunk.block_table)[:total].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            values = _gather(v_cache, chunk.block_table)[:total].transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(ctx, total, device=q.device).unsqueeze(1)
            kpos = torch.arange(total, device=q.device).unsqueeze(0)
            mask = kpos <= qpos  # [n, L]
            if window:
                mask &= kpos > qpos - window
            attn = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out.copy_(attn.squeeze(0).transpose(0, 1))  # [n, H, D]


def _window_mask(batch: ForwardBatch, window: int) -> torch.Tensor:
    """The decode mask of a layer with a sliding window: each row's last `window` positions (once a step per
    window size, kept on the batch for the layers after)."""
    assert batch.decode_mask is not None and batch.decode_context_lens is not None
    mask = batch.decode_window_masks.get(window)
    if mask is None:
        span = torch.arange(batch.decode_mask.shape[-1], device=batch.decode_mask.device)
        inside = span >= (batch.decode_context_lens - window).unsqueeze(1)
        mask = batch.decode_window_masks[window] = batch.decode_mask & inside[:, None, None, :]
    return mask


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    # [..., NB] block ids -> [..., NB * B, KVH, D]
    g = cache[block_table]
    return g.flatten(-4, -3)
