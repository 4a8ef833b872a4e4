"""What the LoRA compute knows of a model and of an adapter, and nothing more: each merged projection
layer's shape (`LayerShape`, read off the model's layers once), the layer a batch applies to
(`LoRALayer`: its kind and index), and an adapter's tensors as a slot takes them (`AdapterTensors`).
A record and two protocols: the slots and backends import neither a model nor the adapter reader."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class LayerShape:
    """A merged projection layer (q|k|v, o, gate|up, down) as the LoRA slots lay it out."""

    kind: str  # qkv | o | gate_up | down
    in_features: int
    slices: Mapping[str, tuple[int, int]]  # projection name -> its output columns [lo, hi), in order

    @property
    def names(self) -> list[str]:
        return list(self.slices)

    @property
    def out_features(self) -> int:
        return max(hi for _, hi in self.slices.values())


class LoRALayer(Protocol):
    """A projection layer a LoRA batch adds deltas to (layers/linear.py's ProjectionLinear)."""

    @property
    def kind(self) -> str: ...

    @property
    def layer_idx(self) -> int: ...


class AdapterTensors(Protocol):
    """An adapter's weights as a slot loads them (adapters/weights.py's LoRAWeights; where its `flat` buffer holds
    every tensor as a view, LoRASlots moves that buffer to the device in one transfer)."""

    @property
    def adapter_id(self) -> str: ...

    @property
    def rank(self) -> int: ...  # the largest rank over its modules

    @property
    def tensors(self) -> Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]: ...  # (layer, module) -> (A, B)

    @property
    def flat(self) -> torch.Tensor | None: ...  # the one buffer every tensor is a view of; None: separate tensors
