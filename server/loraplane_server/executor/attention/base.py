"""The attention backend interface: a backend, chosen once at engine start, writes each step's keys and
values into the paged KV cache, then attends: the decode rows (one query each) in one batched call, each
prefill chunk on its own (few per step), over its cached context plus itself.

A layer with a sliding window (`window` W > 0: Mistral's every layer, Gemma 3's local ones) attends, from a query at
position p, the keys at positions p - W < j <= p alone, as transformers masks it (masking_utils'
sliding_window_overlay: kv_idx > q_idx - W); 0 is full causal attention."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplane_server.executor.forward_batch import ForwardBatch, PrefillChunk


class AttentionBackend(ABC):
    name: str  # the attention_backend config value that selects it
    cpu_kernels = False  # attends with the CPU kernels, as the fused CPU decoder layer does (models/llama.py)

    def __init__(self, kernel_kv_write: bool = False) -> None:
        """kernel_kv_write: write_kv through the CPU kernel's row copy, the same bits as index_copy_ (slow on
        the strided k, v views of the qkv projection); on where the layer kernels run (backends.py)."""
        self.kernel_kv_write = kernel_kv_write

    def prepare(self, batch: ForwardBatch, block_size: int) -> None:  # noqa: B027 - most backends need nothing
        """Once a step, before the model runs: what every layer of the step reads (none by default)."""

    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """k, v: [T, KVH, D] into the caches [N, B, KVH, D] at flat slots slot_mapping [T]."""

    @abstractmethod
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
        """out [Bd, H, D] = each decode row's query q [Bd, H, D] over its sequence's cached blocks (the last
        `window` positions of them where window > 0)."""

    @abstractmethod
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
        """out [n, H, D] = one prefill chunk's causal attention (q [n, H, D], its own k, v [n, KVH, D],
        already in the cache too) over its cached context plus itself (within `window` where > 0)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for this step's tokens (decode rows first) -> [T, H, D]."""
        self.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = torch.empty_like(q)
        nd = batch.num_decode_tokens
        if nd:
            self.decode(q[:nd], k_cache, v_cache, batch, scale, out[:nd], window)
        for chunk in batch.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
            self.prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, out[rows], window)
        return out
