"""The tensors that describe one engine step to the model, built by the model runner.

Passed explicitly through every layer's forward (no module-level context). A plain record of the step:
the backends that compute it were handed to the layers once, at engine start (backends.py).
Token order: all decode tokens first (one per sequence), then each prefill chunk in turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplane_server.executor.lora.backends.base import LoRABatch


@dataclass
class PrefillChunk:
    query_start: int  # first row of this chunk in the flat token batch
    num_query_tokens: int
    num_context_tokens: int  # tokens before the chunk already in the KV cache
    block_table: torch.Tensor  # [num_blocks] int64, covers context + chunk


@dataclass
class ForwardBatch:
    # [T] int64: each token's row in the rotary table, its position but for LongRoPE's long rows (RotaryEmbedding.rows)
    positions: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot for each token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor | None  # [Bd] int64, including the new token
    # [Bd, 1, 1, max_blocks * block_size] bool: set by the torch attention backend's prepare (its own alone)
    decode_mask: torch.Tensor | None = None
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # the same, per sliding window
    prefills: list[PrefillChunk] = field(default_factory=list)
    logits_indices: torch.Tensor | None = None  # [S] rows whose next token is sampled
    lora: LoRABatch | None = None  # per-token adapter slots; None when no token has an adapter
    logits_lora: LoRABatch | None = None  # the same for the logits rows alone (see logits_rows_batch)
    # a model with global and sliding layers: the step as the sliding layers see it (their own KV pool's slot
    # mapping and block tables, engine/kv_groups.py); None otherwise
    window_batch: ForwardBatch | None = None

    @property
    def prunes_last_layer(self) -> bool:
        """Whether some rows produce no logits: then the last layer's o projection and MLP, whose
        outputs feed nothing but the logits, run on the logits rows alone (its keys and values are
        written for every row by then)."""
        return self.logits_indices is not None and len(self.logits_indices) < len(self.positions)

    def logits_rows_batch(self) -> ForwardBatch:
        """This step as seen by layers that run on the logits rows alone (row i = logits_indices[i])."""
        return replace(self, lora=self.logits_lora, logits_lora=None, logits_indices=None)
