"""The Triton LoRA backend (CUDA, or TRITON_INTERPRET=1): every adapter row of the step, decode rows in runs of
one adapter (the model runner orders them by slot) and prefill runs as they come, in one SGMV launch per matmul
(kernels/triton_lora.py), mixed ranks in one launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraplane_server.executor.lora.backends.base import LoRABackend, LoRABatch

if TYPE_CHECKING:
    from loraplane_server.executor.lora.layout import LoRALayer
    from loraplane_server.executor.lora.slots import LoRASlots


class TritonLoRABatch(LoRABatch):
    def __init__(
        self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]], device: torch.device
    ) -> None:
        super().__init__(slots, decode_slots, segments)
        segs = slot_runs(decode_slots, slots.none_slot)
        segs += [(start, end - start, s) for start, end, s in segments]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        self.starts = as_tensor([s for s, _, _ in segs])
        self.lens = as_tensor([n for _, n, _ in segs])
        self.seg_slots = as_tensor([s for _, _, s in segs])
        self.ranks = {kind: as_tensor([w.get(kind, 0) for w in slots.widths]) for kind in slots.layouts}
        self.max_seg_len = max((n for _, n, _ in segs), default=0)  # sizes the grid without a device sync

    def apply(self, layer: LoRALayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from loraplane_server.kernels.triton_lora import sgmv_expand, sgmv_shrink

        if layer.kind not in self.kinds or self.starts.numel() == 0:
            return out
        a = self.slots.a[layer.kind][layer.layer_idx]  # [S+1, P*R, in]
        b = self.slots.b[layer.kind][layer.layer_idx]  # [S+1, out, P*R]
        h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)  # [T, P*R]
        segs = (self.starts, self.lens, self.seg_slots, self.ranks[layer.kind])
        sgmv_shrink(x, a, *segs, h, max_seg_len=self.max_seg_len)
        sgmv_expand(h, b, *segs, out, 0, max_seg_len=self.max_seg_len)
        return out


def slot_runs(row_slots: list[int], none: int, longest: int | None = None) -> list[tuple[int, int, int]]:
    """(first row, rows, slot) for each run of consecutive rows on one adapter slot (rows of `none` left out), a run
    cut every `longest` rows when given: the model runner puts a step's decode rows in slot order on this backend,
    so each adapter's A and B are read once per run, not once per row (pure)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(row_slots):
        if slot == none:
            continue
        if (
            runs
            and runs[-1][2] == slot
            and runs[-1][0] + runs[-1][1] == i
            and (longest is None or runs[-1][1] < longest)
        ):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, slot)
        else:
            runs.append((i, 1, slot))
    return runs


class TritonBackend(LoRABackend):
    name = "triton"

    def prepare(
        self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]], num_tokens: int
    ) -> TritonLoRABatch:
        return TritonLoRABatch(slots, decode_slots, segments, self.device)
