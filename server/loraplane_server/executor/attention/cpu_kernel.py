"""The CPU kernel attention backend (kernels/cpu_kernels.py): decode rows through csrc/paged_attention_cpu.cpp,
prefill chunks in bf16 (head_dim 64 or 128, a build with the bf16 paths: AVX-512 BF16 or AVX2) through
csrc/prefill_attention_cpu.cpp's flash attention, both reading the KV blocks in place; other prefill chunks
through torch's SDPA."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraplane_server.executor.attention.torch_ref import TorchAttention
from loraplane_server.kernels import cpu_kernels

if TYPE_CHECKING:
    from loraplane_server.executor.forward_batch import ForwardBatch, PrefillChunk


class CPUKernelAttention(TorchAttention):
    name = "cpu_kernel"
    cpu_kernels = True

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
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out, window=window)

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
        if not cpu_kernels.prefill_kernel_applies(q):
            super().prefill(q, k, v, k_cache, v_cache, chunk, scale, out, window)
            return
        ctx = chunk.num_context_tokens
        cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, chunk.block_table, ctx, scale, window)
