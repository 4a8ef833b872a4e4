"""The LoRA backend interface: a backend, chosen once at engine start, turns each step's adapter slots
into a `LoRABatch`, which the projection layers call to add every row's own adapter delta.

Every backend reads a row's own slot alone, never another slot's weights, not even times zero:
0 x NaN is NaN, so a row's output never depends on an adapter it does not use (a hostile one's NaN
stays its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from loraplane_server.executor.lora.layout import LayerShape, LoRALayer
from loraplane_server.executor.lora.slots import LoRASlots


class LoRABatch(ABC):
    """One step's adapters as a backend prepared them (decode rows first, then prefill segments)."""

    def __init__(self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]]) -> None:
        self.slots = slots
        used = {s for s in decode_slots if s != slots.none_slot} | {s for _, _, s in segments}
        self.kinds = {k for s in used for k in slots.widths[s]}  # the layer kinds some adapter targets

    @property
    def is_empty(self) -> bool:
        return not self.kinds

    def targets(self, layer: LoRALayer) -> bool:
        """Whether some adapter of this step adds a delta to `layer`'s output."""
        return layer.kind in self.kinds

    def fused_row_slots(self) -> torch.Tensor | None:
        """Each row's slot as the fused CPU decoder layer (cpu_kernels.decoder_layer) takes it; None where this
        backend's slots are not the layout it reads (the Python layers then run the step)."""
        return None

    def fused_layer_args(self, layer_idx: int) -> list[torch.Tensor | None]:
        """The fused CPU decoder layer's LoRA arguments for layer `layer_idx` (only where fused_row_slots is
        not None)."""
        raise NotImplementedError(f"{type(self).__name__} does not feed the fused CPU decoder layer")

    @abstractmethod
    def apply(self, layer: LoRALayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out] += the LoRA delta (shrink by A, expand by B) of every row's adapter for this
        merged layer; returns out."""


class LoRABackend(ABC):
    name: str  # the lora_backend config value (or layer backend) that selects it
    packed_slots: bool = False  # whether its slots hold the CPU kernel's packed layout, not the dense one

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def make_slots(
        self, shapes: list[LayerShape], num_layers: int, num_slots: int, max_rank: int, dtype: torch.dtype
    ) -> LoRASlots:
        """The device slots in the layout this backend reads, from the model's merged layer shapes."""
        return LoRASlots(shapes, num_layers, num_slots, max_rank, dtype, self.device, self.packed_slots)

    @abstractmethod
    def prepare(
        self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]], num_tokens: int
    ) -> LoRABatch:
        """A step's batch. decode_slots: the slot of each decode row (none_slot for the base model);
        segments: (start, end, slot) runs of prefill rows; num_tokens: rows in the step."""
