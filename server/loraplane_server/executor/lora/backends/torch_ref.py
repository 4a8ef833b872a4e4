"""The torch LoRA backend (CPU, any dtype). Decode rows: with every row on one adapter, plain matmuls
on its slot; with few distinct adapters, the rows of each used slot taken together and multiplied by
that slot's A and B (grouped: each adapter read once); with many, each row gathers its own slot's A and
B for two batched matmuls (BGMV: weight traffic per row). Prefill rows: contiguous runs of one slot,
multiplied per run (segments by adapter). No Python loop over requests."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from loraplane_server.executor.lora.backends.base import LoRABackend, LoRABatch

if TYPE_CHECKING:
    from loraplane_server.executor.lora.layout import LoRALayer
    from loraplane_server.executor.lora.slots import LoRASlots


class TorchLoRABatch(LoRABatch):
    def __init__(
        self,
        slots: LoRASlots,
        decode_slots: list[int],
        segments: list[tuple[int, int, int]],
        device: torch.device,
        dense_max_slots: int,
    ) -> None:
        super().__init__(slots, decode_slots, segments)
        self.segments = segments
        self.num_decode = len(decode_slots)
        # decode gathers only the columns some decode slot uses (compact layout: the rest are zeros)
        self.decode_width = {
            k: max((slots.widths[s].get(k, 0) for s in set(decode_slots)), default=0) for k in self.kinds
        }
        self.decode_slots = (
            torch.tensor(decode_slots, dtype=torch.int64, device=device)
            if any(s != slots.none_slot for s in decode_slots)
            else None
        )
        decode_used = sorted({s for s in decode_slots if s != slots.none_slot})
        # every decode row on one adapter (a lone request, or one hot adapter): plain matmuls on its slot
        self.single = decode_used[0] if len(set(decode_slots)) == 1 and decode_used else None
        # grouped: the decode rows on adapters, ordered by slot (`order`), as one run per slot
        self.grouped: list[tuple[int, int, int]] | None = None  # (slot, start, end) into `order`
        self.order: torch.Tensor | None = None
        if self.single is None and 0 < len(decode_used) <= dense_max_slots:
            rows = sorted(
                (i for i, r in enumerate(decode_slots) if r != slots.none_slot), key=lambda i: decode_slots[i]
            )
            self.order = torch.tensor(rows, device=device)
            counts = [decode_slots.count(s) for s in decode_used]
            ends = list(itertools.accumulate(counts))
            self.grouped = [(s, end - n, end) for s, n, end in zip(decode_used, counts, ends, strict=True)]

    def apply(self, layer: LoRALayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if layer.kind not in self.kinds:
            return out
        a = self.slots.a[layer.kind][layer.layer_idx]  # [S+1, P*R, in]
        bt = self.slots.bt[layer.kind][layer.layer_idx]  # [S+1, P*R, out]: a slot's B^T rows are contiguous
        nd = self.num_decode
        w = self.decode_width[layer.kind]
        if self.single is not None and w:
            out[:nd] += (x[:nd] @ a[self.single, :w].T) @ bt[self.single, :w]
        elif self.grouped is not None and w:
            self._decode_grouped(layer.kind, a, bt, x[:nd], out[:nd])
        elif self.decode_slots is not None and w:
            h = torch.bmm(a[:, :w][self.decode_slots], x[:nd].unsqueeze(-1))  # [Bd, w, 1]
            out[:nd] += torch.bmm(h.transpose(1, 2), bt[:, :w][self.decode_slots]).squeeze(1)  # [Bd, out]
        for start, end, slot in self.segments:
            width = self.slots.widths[slot].get(layer.kind)
            if width:
                out[start:end] += (x[start:end] @ a[slot, :width].T) @ bt[slot, :width]
        return out

    def _decode_grouped(self, kind: str, a: torch.Tensor, bt: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        """Each slot's rows, taken together in slot order, times that slot's A and B alone: one gather,
        one small matmul pair per slot, one scatter (0.5 ms for 64 rows over 16 adapters on gate_up,
        against 0.9 for the one-hot mask it replaced, which multiplied every row by every slot)."""
        assert self.grouped is not None and self.order is not None
        xs = x.index_select(0, self.order)  # [rows on adapters, in], runs of one slot
        delta = x.new_zeros(xs.shape[0], out.shape[1])  # zeros stay for a slot that skips this kind
        for slot, start, end in self.grouped:
            w = self.slots.widths[slot].get(kind)
            if w:
                torch.matmul(xs[start:end] @ a[slot, :w].T, bt[slot, :w], out=delta[start:end])
        out.index_add_(0, self.order, delta)


class TorchBackend(LoRABackend):
    name = "torch"
    DENSE_MAX_SLOTS = 16  # distinct decode adapters up to which grouped matmuls beat BGMV on CPU

    def prepare(
        self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]], num_tokens: int
    ) -> TorchLoRABatch:
        return TorchLoRABatch(slots, decode_slots, segments, self.device, self.DENSE_MAX_SLOTS)
