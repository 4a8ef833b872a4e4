"""Linear layers whose output is one or more named projections that an adapter may target.

A merged layer (q|k|v, gate|up) runs one matmul for all its projections; each projection keeps
its name and output slice, so a LoRA delta can be added to exactly its part of the output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraplane_server.executor.forward_batch import ForwardBatch
from loraplane_server.executor.layers.quant import quantize_int8, torch_int8_linear
from loraplane_server.executor.lora.layout import LayerShape
from loraplane_server.kernels import cpu_kernels


def base_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: bool) -> torch.Tensor:
    """F.linear, or the CPU kernel when asked and x is up to linear_max_rows() bf16 rows (bench/linear.py)."""
    if kernels and x.shape[0] <= cpu_kernels.linear_max_rows() and x.dtype == torch.bfloat16 and x.dim() == 2:
        if x.stride(-1) == 1 and weight.is_contiguous():
            return cpu_kernels.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Int8Weight(NamedTuple):
    """A linear layer's weight as executor/layers/quant.py's quantize_int8 gives it."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N]
    wsum: torch.Tensor  # int32 [N]


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, kernels: bool) -> torch.Tensor:
    """x (scale * q)^T (+ bias): the CPU kernel (bf16 x, the layer kernels on), Triton on CUDA, torch otherwise."""
    if kernels and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1:
        return cpu_kernels.linear_int8(x, w.q, w.scale, w.wsum, bias)
    if x.is_cuda:
        from loraplane_server.kernels import triton_int8  # Triton only where CUDA runs

        return triton_int8.int8_linear(x, w.q, w.scale, bias)
    return torch_int8_linear(x, w.q, w.scale, bias)


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
        # int8 weights (quantize_int8): weight is then int8 and these its per-channel scales and row sums
        self.weight_scale: torch.Tensor | None = None
        self.weight_sum: torch.Tensor | None = None
        # a pre-quantized checkpoint's int8 projections, by name, until finish_load assembles them
        self._int8_parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def int8(self) -> bool:
        return self.weight.dtype == torch.int8

    def lora_shape(self) -> LayerShape:
        """This layer as the LoRA slots lay it out (executor/lora/layout.py)."""
        return LayerShape(self.kind, self.in_features, dict(self.slices))

    def quantize_int8(self) -> None:
        """The weight as int8 with a scale per output channel (executor/layers/quant.py), once, after loading; the
        float copy is freed. A weight that is int8 already (a pre-quantized checkpoint) stays as it is."""
        if self.int8:
            return
        q, scale, wsum = quantize_int8(self.weight.data)
        self._set_int8(q, scale)

    def _set_int8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        device = self.weight.device
        self.weight = nn.Parameter(q.to(device), requires_grad=False)
        self.weight_scale = scale.to(device=device, dtype=torch.float32)
        self.weight_sum = self.weight.data.sum(dim=1, dtype=torch.int32)

    def load_int8(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Projection `name`'s int8 weight [rows, K] and per-channel scale [rows] from a pre-quantized checkpoint
        (executor/models/quantized.py); held until finish_load, once the checkpoint has been read."""
        lo, hi = self.slices[name]
        if tuple(q.shape) != (hi - lo, self.in_features) or tuple(scale.shape) != (hi - lo,):
            raise ValueError(
                f"{name}: int8 weight {tuple(q.shape)} with scale {tuple(scale.shape)}, expected "
                f"({hi - lo}, {self.in_features}) with ({hi - lo},)"
            )
        self._int8_parts[name] = (q, scale)

    def finish_load(self) -> None:
        """Assemble the int8 projections load_int8 was given into one int8 weight. A merged layer whose
        checkpoint quantized some of its projections only gets the others quantized per channel too (one
        weight, one dtype)."""
        if not self._int8_parts:
            return
        q = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        scale = torch.empty(self.out_features, dtype=torch.float32)
        for name, (lo, hi) in self.slices.items():
            part = self._int8_parts.get(name)
            if part is None:
                part = quantize_int8(self.weight.data[lo:hi].cpu())[:2]
            q[lo:hi], scale[lo:hi] = part
        self._int8_parts = {}
        self._set_int8(q, scale)

    def load(self, name: str, part: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (part 'weight' or 'bias') into projection `name`'s slice."""
        lo, hi = self.slices[name]
        target = self.weight if part == "weight" else self.bias
        if target is None:
            raise ValueError(f"{name}: checkpoint has a bias the config does not declare")
        if tuple(target[lo:hi].shape) != tuple(tensor.shape):
            raise ValueError(f"{name}.{part}: shape {tuple(tensor.shape)}, expected {tuple(target[lo:hi].shape)}")
        target.data[lo:hi].copy_(tensor)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) without LoRA: base_linear, or the int8 weight through its kernel."""
        if not self.int8:
            return base_linear(x, self.weight, self.bias, self.kernels)
        assert self.weight_scale is not None and self.weight_sum is not None
        return int8_linear(x, Int8Weight(self.weight, self.weight_scale, self.weight_sum), self.bias, self.kernels)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate|up layer in one kernel call (the CPU kernels, bf16 x)."""
        if not self.int8:
            return cpu_kernels.linear_silu_mul(x, self.weight, self.bias)
        assert self.weight_scale is not None and self.weight_sum is not None
        return cpu_kernels.linear_int8_silu_mul(x, self.weight, self.weight_scale, self.weight_sum, self.bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        out = self.base(x)  # [T, out]
        if batch.lora is not None:
            out = batch.lora.apply(self, x, out)
        return out
