"""RMSNorm, computed in float32 as the reference implementations do; optionally fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplane_server.kernels import cpu_kernels, triton_layer_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.triton = False  # the Triton layer op (CUDA: LlamaForCausalLM.use_backends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fused, and bitwise equal to x * rsqrt(mean(x^2) + eps) in float32 as transformers computes it
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None, kernels: bool) -> torch.Tensor:
        """residual += delta in place (the residual stream), then the norm of it. With `kernels` and
        bf16 on the CPU, one fused pass (csrc/layer_ops_cpu.cpp)."""
        if kernels and residual.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return cpu_kernels.add_rms_norm(residual, delta, self.weight, self.eps)
        if self.triton and residual.dtype == self.weight.dtype and _unit_rows(residual, delta):
            return triton_layer_ops.add_rms_norm(residual, delta, self.weight, self.eps)
        if delta is not None:
            residual.add_(delta)  # the same rounding as `residual + delta`
        return self(residual)


def _unit_rows(residual: torch.Tensor, delta: torch.Tensor | None) -> bool:
    """Rows of unit column stride, as the Triton norm reads them."""
    return residual.dim() == 2 and residual.stride(1) == 1 and (delta is None or delta.stride(-1) == 1)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w - 1 (zeros at init) and the scale (1 + w) multiplies in
    float32 before the cast back. No CPU kernel computes this form, so add_forward stays in torch."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None, kernels: bool) -> torch.Tensor:
        if delta is not None:
            residual.add_(delta)
        return self(residual)
