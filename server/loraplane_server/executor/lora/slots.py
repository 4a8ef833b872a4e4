"""Device-resident LoRA weights: one stacked tensor pair per merged layer kind, slot-indexed.

For a merged layer with P projections (q|k|v: P=3), slot s holds A as [P*R, in] and B as
[out, P*R] (stored transposed, see `bt`): projection p's A rows sit at [p*r, p*r + r_p) and its
B columns likewise, where r is the slot's rank, so B is block-diagonal and one shrink plus one
expand cover all P projections.
Slot index num_slots is all zeros: tokens without an adapter gather it and add nothing.

With `packed` (the CPU kernels), the slots hold their weights instead in one contiguous run per
slot and layer (`packed[kind][layer, slot]`; `a`, `b`, `bt` stay empty): for each projection p the
adapter targets, A_p [rank, in] then B_p^T [rank, width_p], back to back, at
`packed_rows[kind][layer, slot, p]` = (offset, rank).
A decode row then reads its adapter in one ~30 KB run (q and v at rank 8) instead of 18 runs of
0.4-9 KB spread over the dense layout's zero blocks (csrc/lora_cpu.cpp, bgmv_packed_).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from loraplane_server.executor.lora.layout import AdapterTensors, LayerShape


class LoRASlots:
    """The slots of every merged layer kind in `shapes` (one per kind, the same in each of `num_layers`
    layers); the LoRA backend chooses the layout (its `make_slots`: dense, or packed for the CPU kernel)."""

    def __init__(
        self,
        shapes: Iterable[LayerShape],
        num_layers: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        packed: bool = False,
    ) -> None:
        self.num_slots = num_slots
        self.none_slot = num_slots
        self.device = torch.device(device)
        self.max_rank = max_rank
        self.layouts: dict[str, LayerShape] = {shape.kind: shape for shape in shapes}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.bt: dict[str, torch.Tensor] = {}
        for kind, lin in self.layouts.items():
            if packed:
                break  # the CPU kernel reads only the packed copy: no dense one
            width = len(lin.names) * max_rank
            self.a[kind] = torch.zeros(num_layers, num_slots + 1, width, lin.in_features, dtype=dtype, device=device)
            # B is stored transposed, [width, out] per slot, so a decode gather of a slot's first w rows
            # copies contiguous rows; `b` is the [out, width] view of the same memory
            self.bt[kind] = torch.zeros(num_layers, num_slots + 1, width, lin.out_features, dtype=dtype, device=device)
            self.b[kind] = self.bt[kind].transpose(-1, -2)
        # rows[kind][layer, slot, p] = (first rank row, rows) of projection p (block-diagonal layout);
        # (0, 0) where the slot's adapter does not target it. The CPU kernel skips the zero blocks.
        self.rows: dict[str, torch.Tensor] = {
            kind: torch.zeros(num_layers, num_slots + 1, len(lin.names), 2, dtype=torch.int64)
            for kind, lin in self.layouts.items()
        }
        # out_bounds[kind]: [P + 1] output column boundaries of the projections
        self.out_bounds: dict[str, torch.Tensor] = {
            kind: torch.tensor([0, *(lin.slices[name][1] for name in lin.names)], dtype=torch.int64)
            for kind, lin in self.layouts.items()
        }
        self.packed: dict[str, torch.Tensor] | None = None
        self.packed_rows: dict[str, torch.Tensor] = {}
        if packed:
            self.packed = {
                kind: torch.zeros(
                    num_layers,
                    num_slots + 1,
                    sum(max_rank * (lin.in_features + hi - lo) for lo, hi in lin.slices.values()),
                    dtype=dtype,
                    device=device,
                )
                for kind, lin in self.layouts.items()
            }
            self.packed_rows = {kind: torch.zeros_like(rows) for kind, rows in self.rows.items()}
        self.widths: list[dict[str, int]] = [{} for _ in range(num_slots + 1)]  # used columns per kind
        self.adapter_in: list[str | None] = [None] * num_slots

    def kind_of(self, module: str) -> tuple[str, int]:
        for kind, lin in self.layouts.items():
            if module in lin.names:
                return kind, lin.names.index(module)
        raise KeyError(module)

    def load(self, slot: int, weights: AdapterTensors) -> None:
        """Copy an adapter's weights into slot (replacing whatever was there). Weights held in one host buffer
        (`flat`) reach a dense slot on another device in one transfer of it, then copies there."""
        self.clear(slot)
        r = weights.rank
        tensors = weights.tensors
        if self.packed is None:
            tensors = on_device(weights, self.device)
        for (layer, module), (a, b) in tensors.items():
            kind, p = self.kind_of(module)
            lo, hi = self.layouts[kind].slices[module]
            rank = a.shape[0]
            if self.packed is None:
                self.a[kind][layer, slot, p * r : p * r + rank].copy_(a)
                self.b[kind][layer, slot, lo:hi, p * r : p * r + rank].copy_(b)
            self.rows[kind][layer, slot, p] = torch.tensor([p * r, rank])
            self.widths[slot][kind] = len(self.layouts[kind].names) * r
        if self.packed is not None:
            self._pack(slot, weights)
        self.adapter_in[slot] = weights.adapter_id

    def _pack(self, slot: int, weights: AdapterTensors) -> None:
        """The packed copy: per (kind, layer), the targeted projections in order, A_p then B_p^T."""
        assert self.packed is not None
        targets: dict[tuple[str, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in weights.tensors.items():
            kind, p = self.kind_of(module)
            targets.setdefault((kind, layer), []).append((p, a, b))
        for (kind, layer), projections in targets.items():
            run = self.packed[kind][layer, slot]
            offset = 0
            for p, a, b in sorted(projections, key=lambda item: item[0]):
                rank, width = a.shape[0], b.shape[0]
                run[offset : offset + a.numel()].copy_(a.reshape(-1))
                run[offset + a.numel() : offset + a.numel() + b.numel()].view(rank, width).copy_(b.t())
                self.packed_rows[kind][layer, slot, p] = torch.tensor([offset, rank])
                offset += a.numel() + b.numel()

    def clear(self, slot: int) -> None:
        for kind in self.widths[slot]:
            if self.packed is None:
                self.a[kind][:, slot].zero_()
                self.b[kind][:, slot].zero_()
            else:
                self.packed_rows[kind][:, slot].zero_()
            self.rows[kind][:, slot].zero_()
        self.widths[slot] = {}
        self.adapter_in[slot] = None


def on_device(
    weights: AdapterTensors, device: torch.device
) -> Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """weights.tensors, on `device`: with a `flat` buffer elsewhere, that buffer moved in one transfer
    (asynchronous from page-locked memory) and each pair the same view of the copy; else as they are."""
    flat = weights.flat
    if flat is None or flat.device == device:
        return weights.tensors
    moved = flat.to(device, non_blocking=flat.is_pinned())
    base, size = flat.data_ptr(), flat.element_size()

    def view(t: torch.Tensor) -> torch.Tensor:
        start = (t.data_ptr() - base) // size
        if not t.is_contiguous() or start < 0 or start + t.numel() > flat.numel():
            raise ValueError(f"adapter {weights.adapter_id}: a tensor is not a view of its flat buffer")
        return moved[start : start + t.numel()].view(t.shape)

    return {key: (view(a), view(b)) for key, (a, b) in weights.tensors.items()}
