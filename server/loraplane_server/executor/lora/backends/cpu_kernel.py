"""The CPU kernel LoRA backend (bf16, packed slots): one call per layer covers every row of the step,
decode and prefill alike. csrc/lora_cpu.cpp (`bgmv_packed_`) reads each row's slot in place from its
one contiguous run per layer (executor/lora/slots.py) and multiplies each targeted projection's A and B; the
fused decoder layer (executor/models/llama.py) takes the same arguments through `fused_layer_args`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraplane_server.executor.lora.backends.base import LoRABackend, LoRABatch
from loraplane_server.kernels import cpu_kernels

if TYPE_CHECKING:
    from loraplane_server.executor.lora.layout import LoRALayer
    from loraplane_server.executor.lora.slots import LoRASlots


class CPUKernelLoRABatch(LoRABatch):
    KERNEL_KINDS = ("qkv", "o", "gate_up", "down")  # the order of cpu_kernels.decoder_layer's lora list

    def __init__(
        self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]], num_tokens: int
    ) -> None:
        super().__init__(slots, decode_slots, segments)
        if slots.packed is None:
            raise RuntimeError("the CPU kernel LoRA backend needs packed LoRA slots")
        self.packed = slots.packed
        rows = decode_slots + [slots.none_slot] * (num_tokens - len(decode_slots))
        for start, end, slot in segments:
            rows[start:end] = [slot] * (end - start)
        self.row_slots = torch.tensor(rows, dtype=torch.int64)  # [T] slot per row of the step

    def fused_row_slots(self) -> torch.Tensor:
        return self.row_slots

    def fused_layer_args(self, layer_idx: int) -> list[torch.Tensor | None]:
        """cpu_kernels.decoder_layer's lora list for layer `layer_idx`: bgmv_packed_'s (packed, proj,
        out_bounds) for each kind some adapter of the step targets, None for the others."""
        slots = self.slots
        args: list[torch.Tensor | None] = []
        for kind in self.KERNEL_KINDS:
            if kind in self.kinds:
                args += [self.packed[kind][layer_idx], slots.packed_rows[kind][layer_idx], slots.out_bounds[kind]]
            else:
                args += [None, None, None]
        return args

    def apply(self, layer: LoRALayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if layer.kind not in self.kinds:
            return out
        if x.dtype != torch.bfloat16 or x.shape[0] != self.row_slots.shape[0]:
            raise RuntimeError("packed LoRA slots need the CPU kernel: bf16 rows, one slot per row")
        packed = self.packed[layer.kind][layer.layer_idx]  # [S+1, C]: each slot's weights in one contiguous run
        proj = self.slots.packed_rows[layer.kind][layer.layer_idx]  # [S+1, P, 2]
        bounds = self.slots.out_bounds[layer.kind]
        cpu_kernels.bgmv_packed_(out, x, packed, self.row_slots, proj, bounds, self.slots.none_slot)
        return out


class CPUKernelBackend(LoRABackend):
    name = "cpu_kernel"
    packed_slots = True

    def prepare(
        self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]], num_tokens: int
    ) -> CPUKernelLoRABatch:
        return CPUKernelLoRABatch(slots, decode_slots, segments, num_tokens)
