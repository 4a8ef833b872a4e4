"""The Triton attention backend (CUDA, or TRITON_INTERPRET=1): decode rows through the paged decode kernel
of kernels/triton_attention.py, which reads the KV blocks in place; a prefill chunk over a cached context
through its paged prefill kernel (the context read in place, never gathered); a chunk with no context (a
fresh prompt) through torch's SDPA on its own keys and values (flash attention on CUDA), unless a sliding window is
shorter than it (then the paged prefill kernel, which masks by the window and skips the key tiles before it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraplane_server.executor.attention.torch_ref import TorchAttention
from loraplane_server.kernels import triton_attention

if TYPE_CHECKING:
    from loraplane_server.executor.forward_batch import ForwardBatch, PrefillChunk


class TritonAttention(TorchAttention):
    name = "triton"

    def prepare(self, batch: ForwardBatch, block_size: int) -> None:
        pass  # the kernel reads each row's context length: no mask

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
        assert batch.decode_block_tables is not None and batch.decode_context_lens is not None
        tables, lens = batch.decode_block_tables, batch.decode_context_lens
        out.copy_(triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window))

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
        ctx = chunk.num_context_tokens
        if ctx == 0 and not 0 < window < chunk.num_query_tokens:  # SDPA (flash) on its own keys and values
            super().prefill(q, k, v, k_cache, v_cache, chunk, scale, out)
            return
        table = chunk.block_table
        if out.stride(2) == 1 and out.stride(1) == out.shape[2]:
            triton_attention.paged_prefill_attention(q, k_cache, v_cache, table, ctx, scale, out, window)
        else:
            out.copy_(triton_attention.paged_prefill_attention(q, k_cache, v_cache, table, ctx, scale, window=window))
