"""Linear layers whose output is one or more named projections that an adapter may target.

A merged layer (q|k|v, gate|up) runs one matmul for all its projections; each projection keeps
its name and output slice, so a LoRA delta can be added to exactly its part of the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplane_server.forward_batch import ForwardBatch
from loraplane_server.layers import cpu_kernels


def base_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: bool) -> torch.Tensor:
    """F.linear, or the CPU kernel when asked and x is up to linear_max_rows() bf16 rows (bench/linear.py)."""
    if kernels and x.shape[0] <= cpu_kernels.linear_max_rows() and x.dtype == torch.bfloat16 and x.dim() == 2:
        if x.stride(-1) == 1 and weight.is_contiguous():
            return cpu_kernels.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class ProjectionLinear(nn.Module):
    def __init__(
        self, in_features: int, outputs: dict[str, int], bias: bool = False, kind: str = "", layer_idx: int = 0
    ) -> None:
        super().__init__()
        self.kind = kind  # qkv | o | gate_up | down: which stacked LoRA slots serve this layer
        self.layer_idx = layer_idx
        self.in_features = in_features
        self.names = list(outputs)
        self.slices: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in outputs.items():
            self.slices[name] = (start, start + size)
            start += size
        self.out_features = start
        self.weight = nn.Parameter(torch.empty(start, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(start), requires_grad=False) if bias else None
        self.kernels = False  # the bf16 CPU layer kernels (the model's use_backends)

    def load(self, name: str, part: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (part 'weight' or 'bias') into projection `name`'s slice."""
        lo, hi = self.slices[name]
        target = self.weight if part == "weight" else self.bias
        if target is None:
            raise ValueError(f"{name}: checkpoint has a bias the config does not declare")
        if tuple(target[lo:hi].shape) != tuple(tensor.shape):
            raise ValueError(f"{name}.{part}: shape {tuple(tensor.shape)}, expected {tuple(target[lo:hi].shape)}")
        target.data[lo:hi].copy_(tensor)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        out = base_linear(x, self.weight, self.bias, self.kernels)  # [T, out]
        if batch.lora is not None:
            out = batch.lora.apply(self, x, out)
        return out
