"""The Triton attention backend (CUDA, or TRITON_INTERPRET=1): decode rows through the paged decode kernel
of layers/triton_attention.py, which reads the KV blocks in place; prefill chunks through torch's SDPA."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraplane_server.attention.torch_ref import TorchAttention
from loraplane_server.layers import triton_attention

if TYPE_CHECKING:
    from loraplane_server.forward_batch import ForwardBatch


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
    ) -> None:
        assert batch.decode_block_tables is not None and batch.decode_context_lens is not None
        tables, lens = batch.decode_block_tables, batch.decode_context_lens
        out.copy_(triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
